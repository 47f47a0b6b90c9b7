"""``commgate init``: the starting point of a repository of your own. It writes a scenario folder (default
``comm/``) with one scenario per scheme for your model (your ``nn.Module`` by its build function, a preset,
or a Hugging Face ``config.json`` at reduced scale), the pytest configuration that names the folder when the
repository has none (it never edits a file of yours: it says what to add), ``.gitignore`` naming ``out/``
and ``*.obtained.json`` where the repository has none (else the lines to add), and ``ci.sh``, the one line CI
runs. Every scenario it writes validates and predicts before anything is written; a file that exists is never
overwritten.
"""

from __future__ import annotations

import configparser
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commgate.core.errors import CommgateError, UsageError

DEFAULT_SCHEMES = ("ddp", "zero2", "zero3")
"""What a new repository starts with: torch DDP and DeepSpeed ZeRO-2 and ZeRO-3, on ``dp`` CPU ranks."""
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "fsdp")
"""The schemes init writes: they need no degree but ``dp`` (tensor, pipeline, context and expert parallelism
and ZeRO++'s partitions each need their own, which init has no flag for)."""

CI = """#!/usr/bin/env sh
# commgate's gate, as CI runs it, from the repository's root, with the Python that has commgate installed
# (PYTHON, default python). A change in what the scenarios in {folder}/ send fails the job, saying what
# differs; accept an intended one with: $PYTHON -m pytest {folder}/ --commgate-update-baselines (then commit
# baselines/).
set -eu
PYTHON=${{PYTHON:-python}}
if ! "$PYTHON" -c "import commgate" 2>/dev/null; then
  echo "ci.sh: commgate is not installed for $PYTHON; install it there, or set PYTHON=/path/to/python that has it" >&2
  exit 2
fi
"$PYTHON" -m pytest {folder}/ -p no:cacheprovider --junitxml out/commgate/junit.xml --commgate-report-dir out/commgate
"""


@dataclass(frozen=True)
class Start:
    """What ``commgate init`` writes (path -> text) and what it says (one line each)."""

    files: dict[Path, str]
    notes: list[str] = field(default_factory=list)


def pytest_config(repo: Path) -> Path | None:
    """The file that configures pytest in ``repo`` (pytest's own order: pytest.toml, .pytest.toml, pytest.ini,
    .pytest.ini, pyproject.toml with [tool.pytest.ini_options] or [tool.pytest], tox.ini with [pytest],
    setup.cfg with [tool:pytest]), or None."""
    for name in ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini"):  # always pytest's, even empty
        if (repo / name).is_file():
            return repo / name
    pyproject = repo / "pyproject.toml"
    try:
        if pyproject.is_file() and re.search(r"^\[tool\.pytest(\.ini_options)?\]", pyproject.read_text(), re.M):
            return pyproject
    except (OSError, UnicodeDecodeError):
        pass
    for name, section in (("tox.ini", "pytest"), ("setup.cfg", "tool:pytest")):
        parser = configparser.ConfigParser()
        try:
            if parser.read(repo / name) and parser.has_section(section):
                return repo / name
        except configparser.Error:
            continue
    return None


def find_pytest_config(start: Path) -> Path | None:
    """The configuration file pytest reads when run in ``start`` without arguments (its rootdir is the file's
    folder), found by pytest's own search (``start``, then its parents), so that the CLI's defaults are the
    gate's from any subfolder; None where there is none, or only pytest's last resort (a pyproject.toml that
    does not configure pytest: the working directory is the CLI's then, as before). A file pytest refuses is a
    ``UsageError`` in pytest's words: the gate would refuse it too."""
    import inspect

    from _pytest.config.findpaths import locate_config  # pytest's search
    from _pytest.outcomes import OutcomeException  # pytest.fail's, which is no Exception

    search: Any = locate_config
    since_8_1 = "invocation_dir" in inspect.signature(search).parameters  # 8.0 took (args) alone
    try:
        inifile = (search(start, []) if since_8_1 else search([start]))[1]
    except (Exception, OutcomeException) as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise UsageError(f"pytest cannot read its configuration here: {said}; fix it (pytest refuses it too)") from None
    if not isinstance(inifile, Path) or (inifile.name == "pyproject.toml" and pytest_config(inifile.parent) is None):
        return None
    return inifile


MODULE_S = 64
"""The sequence length written for your module (``model.s``, which your ``build(scenario)`` reads as
``scenario.model.s``; a scenario without one says 1): ``commgate init --s`` writes another."""


def _config_note(config: Path, folder: str) -> list[str]:
    """The line to add to the repository's own pytest configuration, as that file writes it: TOML's quoted
    list in pyproject.toml, ini's bare words elsewhere; a folder added to the setting when it is there."""
    named = scenario_dirs(config)  # (init runs in the repository: the names as the file writes them)
    if folder in named:
        return []
    toml = config.suffix == ".toml"  # pyproject.toml, or pytest 9's pytest.toml
    section = "pytest section" if not toml else "[pytest] table" if config.name != "pyproject.toml" else _table(config)
    if named and toml:
        line = f"commgate_scenario_dirs = [{', '.join(json.dumps(d) for d in [*named, folder])}]"
        return [f"{config}: make its commgate_scenario_dirs `{line}` (init does not edit your files)"]
    if named:  # an ini linelist: one folder a line
        return [
            f"{config}: add the line `    {folder}` (indented) below its commgate_scenario_dirs: pytest reads one "
            "folder a line (init does not edit your files)"
        ]
    line = f'commgate_scenario_dirs = ["{folder}"]' if toml else f"commgate_scenario_dirs = {folder}"
    return [f"{config}: add `{line}` to its {section} (commgate init does not edit your files)"]


def _table(pyproject: Path) -> str:
    """pyproject.toml's pytest table: [tool.pytest.ini_options], or pytest 9's [tool.pytest] where it has that."""
    try:
        native = re.search(r"^\[tool\.pytest\]", pyproject.read_text(), re.M)
    except (OSError, UnicodeDecodeError):
        native = None
    return "[tool.pytest] table" if native else "[tool.pytest.ini_options]"


def scenario_dirs(config: Path) -> list[str]:
    """The ``commgate_scenario_dirs`` a pytest configuration file sets (pytest's linelist: whitespace
    separated), as paths from the current directory; [] where it sets none or cannot be read."""
    try:
        if config.suffix == ".toml":  # read as pytest reads it: a TOML array, or a string of names
            import importlib
            import sys

            tomllib = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")  # 3.10: pytest's
            with open(config, "rb") as f:
                doc = tomllib.load(f)
            if config.name == "pyproject.toml":  # [tool.pytest.ini_options], or pytest 9's [tool.pytest]
                tool = doc.get("tool", {}).get("pytest", {})
                value = tool.get("ini_options", tool) if isinstance(tool, dict) else {}
            else:  # pytest.toml's [pytest]
                value = doc.get("pytest", {})
            value = value.get("commgate_scenario_dirs", []) if isinstance(value, dict) else []
            names = value.split() if isinstance(value, str) else [str(v) for v in value if isinstance(v, str)]
        else:
            parser = configparser.ConfigParser()
            parser.read(config)
            section = {"setup.cfg": "tool:pytest"}.get(config.name, "pytest")
            names = parser.get(section, "commgate_scenario_dirs", fallback="").split()
    except (OSError, UnicodeDecodeError, ValueError, configparser.Error):  # tomllib's errors are ValueErrors
        return []
    here = config.parent.resolve() == Path.cwd().resolve()
    return names if here else [n if Path(n).is_absolute() else os.path.relpath(config.parent / n) for n in names]


def _model(
    module: str | None, preset: str | None, hf: Path | None, dp: int, s: int | None = None
) -> tuple[dict[str, Any], str, list[str]]:
    """The scenarios' model block, the name they start with, and what the import of a config.json says it
    left out or took as a default (its notes)."""
    given = [x for x in (module, preset, hf) if x]
    if len(given) != 1:
        raise UsageError("commgate init needs one of --module PKG.MOD:BUILD, --preset NAME, --hf CONFIG.json")
    if module:
        return {"module": module, "s": s or MODULE_S}, module.split(":")[0].split(".")[-1], []
    if preset:
        from commgate.model.transformer import PRESETS

        if preset not in PRESETS:
            close = difflib.get_close_matches(preset, list(PRESETS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(f"--preset {preset!r}: not a model preset; {hint}`commgate presets` lists them")
        return {"preset": preset} | ({"s": s} if s else {}), preset, []
    from commgate.model.importer import build

    assert hf is not None
    imported = build(hf=hf, dp=max(dp, 2), cpu=True)  # the reduced-scale variant a CI runner can run
    return imported.doc["model"] | ({"s": s} if s else {}), Path(hf).stem, imported.notes


def start(
    *,
    repo: Path,
    folder: str = "comm",
    module: str | None = None,
    preset: str | None = None,
    hf: Path | None = None,
    schemes: tuple[str, ...] = DEFAULT_SCHEMES,
    dp: int = 2,
    s: int | None = None,
) -> Start:
    """The files of a new scenario folder in ``repo``; raises ``UsageError`` (one line) on what it cannot
    write: an unknown scheme, a scenario that does not validate, a file that exists."""
    import yaml

    from commgate.model.loader import load_document
    from commgate.model.predict import predict
    from commgate.model.schemes import SCHEMES

    if unknown := [s for s in schemes if s not in SCHEMES]:
        raise UsageError(f"--schemes {','.join(unknown)}: unknown; commgate knows {', '.join(SCHEMES)}")
    if others := [s for s in schemes if s not in DATA_PARALLEL]:
        raise UsageError(
            f"--schemes {','.join(others)}: init writes data-parallel scenarios ({', '.join(DATA_PARALLEL)}); "
            "write one of those, then copy it and set the degree by hand (parallelism.tp, pp, cp, moe or "
            "zero.hpz; docs/scenarios.md)"
        )
    if module and (others := [s for s in schemes if not SCHEMES[s].user_module]):
        able = ", ".join(n for n in DATA_PARALLEL if SCHEMES[n].user_module)
        raise UsageError(  # it named the file it would have written (found by an adversarial pass)
            f"--schemes {','.join(others)}: a user's module (--module) is modelled under {able}; leave "
            f"{','.join(others)} out, or start from --preset or --hf for it"
        )
    model, base, notes = _model(module, preset, hf, dp, s)
    files: dict[Path, str] = {}
    for scheme in schemes:
        name = f"{base}-{scheme}"
        path = repo / folder / f"{name}.yaml"
        doc = {
            "schema_version": 1,
            "name": name,
            "description": f"{base} under {scheme} on {dp} CPU ranks (written by commgate init)",
            "model": model,
            "parallelism": {"scheme": scheme, "dp": dp},
            "steps": 2,
        }
        try:
            for scenario in load_document(doc, file=str(path)):
                predict(scenario)
        except CommgateError as exc:
            raise UsageError(str(exc).replace("\n", "; ")) from None
        files[path] = (
            "# written by commgate init: edit freely (docs/scenarios.md lists every field)\n"
            + yaml.safe_dump(doc, sort_keys=False)
        )
    files[repo / folder / "ci.sh"] = CI.format(folder=folder)
    config = pytest_config(repo)
    line = f"commgate_scenario_dirs = {folder}"
    if config is None:
        files[repo / "pytest.ini"] = f"[pytest]\n{line}\n"
    else:
        notes += _config_note(config, folder)
    # ci.sh and every run write reports under out/; a run that differs leaves what it sent beside its baseline
    # (``*.obtained.json``), which `git add baselines/` committed after a copy over the baseline accepted it
    ignore = repo / ".gitignore"
    if not ignore.exists() and not ignore.is_symlink():
        files[ignore] = "out/\n*.obtained.json\n"
    elif not ignore.is_file():
        notes.append(
            f"{ignore}: not a file; ignore out/ (ci.sh writes reports there) and *.obtained.json (what a run that "
            "differs from its baseline leaves beside it) in your version control"
        )
    else:
        has = set(ignore.read_text(errors="replace").split())
        if not {"out", "out/", "/out", "/out/"} & has:
            notes.append(f"{ignore}: add `out/` (ci.sh writes its reports to out/commgate; init does not edit it)")
        if "*.obtained.json" not in has:
            notes.append(
                f"{ignore}: add `*.obtained.json` (what a run that differs from its baseline leaves beside it, not "
                "to be committed with baselines/)"
            )
    if existing := [str(p) for p in files if p.exists()]:
        raise UsageError(f"{', '.join(existing)}: exists; commgate init never overwrites (remove it, or --dir)")
    return Start(files=files, notes=notes)
