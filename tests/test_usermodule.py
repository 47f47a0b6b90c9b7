"""Your own model (``model: {module: ...}``): the DDP and ZeRO models built from the module itself, on the
meta device, predict what the built-in model predicts for the built-in decoder, reconcile on real runs for
a model unlike it and for one with frozen parameters and buffers, and bad hooks are one-line errors."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from commgate.core.errors import ScenarioError
from commgate.judge.reconcile import reconcile
from commgate.model.loader import load_file, load_text
from commgate.model.predict import predict

MIXER = "commgate.examples.mixer:build"


def text(module: str, par: str, ds: str = "") -> str:
    out = (
        f'schema_version: 1\nname: u\nmodel: {{module: "{module}"}}\nparallelism: {{{par}}}\n'
        "steps: 3\nwarmup_steps: 0\n"
    )
    return out + (f"deepspeed: {ds}\n" if ds else "")


def rows(p):  # type: ignore[no-untyped-def]
    return sorted(
        str((r.op, r.phase, r.elements, r.calls, r.once, r.at_step, r.from_step, r.dtype)) for r in p.collectives
    )


@pytest.mark.parametrize(
    ("par", "ds", "tied"),
    [
        ("scheme: ddp, dp: 3, micro_batches: 2", "", False),
        ("scheme: zero1, dp: 2", "", False),
        ("scheme: zero2, dp: 3, zero: {bucket_elements: 1000}", "", False),
        ("scheme: zero3, dp: 2, activation_checkpointing: true, micro_batches: 2", "", False),
        (
            "scheme: zero3, dp: 2, activation_checkpointing: true",
            "{zero_optimization: {stage3_param_persistence_threshold: 0, stage3_prefetch_bucket_size: 900, "
            "stage3_max_reuse_distance: 3000}}",
            True,
        ),
    ],
    ids=["ddp", "zero1", "zero2-buckets", "zero3-checkpointing-m2", "zero3-tied-knobs"],
)
def test_the_built_in_decoder_as_a_users_module_predicts_as_the_built_in_model(
    par: str, ds: str, tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import user_gpt

    if tied:
        monkeypatch.setenv("USER_GPT_TIED", "1")
    (user,) = load_text(text("user_gpt:build", par, ds))
    builtin = replace(user, model=replace(user_gpt.spec(), module=None))
    assert rows(predict(user)) == rows(predict(builtin))
    assert predict(user).param_count == predict(builtin).param_count


@pytest.mark.parametrize(
    ("par", "ds"),
    [
        ("scheme: ddp, dp: 3, micro_batches: 2, ddp_bucket_mb: 0.02", ""),
        ("scheme: zero2, dp: 3, zero: {bucket_elements: 3000}, micro_batches: 2", ""),
        (
            "scheme: zero3, dp: 2, micro_batches: 2",
            "{zero_optimization: {stage3_param_persistence_threshold: 0, stage3_prefetch_bucket_size: 4000, "
            "stage3_max_reuse_distance: 3000}}",
        ),
        (
            "scheme: zero3, dp: 3, zero: {bucket_elements: 5000}",
            "{zero_optimization: {stage3_param_persistence_threshold: 1000}}",
        ),
    ],
    ids=["ddp-buckets", "zero2-buckets", "zero3-knobs", "zero3-persistence"],
)
def test_a_model_unlike_the_decoder_reconciles_on_real_runs(par: str, ds: str, tmp_path: Path) -> None:
    from commgate.run.launcher import launch_local

    (s,) = load_text(text(MIXER, par, ds))
    rec = reconcile(predict(s), launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops), rec.ops
    assert rec.traffic_measured == rec.traffic_predicted


@pytest.mark.parametrize(
    ("model", "par", "message"),
    [
        ('{module: "no_such_pkg.mod:build"}', "scheme: ddp, dp: 2", "cannot be imported"),
        (f'{{module: "{MIXER}"}}', "scheme: tp, tp: 2", "a user's module is modelled under ddp, zero1, zero2, zero3"),
        (f'{{module: "{MIXER}", L: 4}}', "scheme: ddp, dp: 2", "takes no preset or dimensions"),
    ],
)
def test_bad_module_hooks_are_one_line_errors(model: str, par: str, message: str) -> None:
    doc = f"schema_version: 1\nname: u\nmodel: {model}\nparallelism: {{{par}}}\n"
    with pytest.raises(ScenarioError, match=message) as info:
        load_text(doc)
    assert len(info.value.problems) == 1


def test_a_module_with_nothing_to_train_is_named() -> None:
    """Said as the scenario loads, where the module is measured (it was said when it was predicted, and a run
    stopped at that scenario, its report half-written: found by an adversarial pass)."""
    with pytest.raises(ScenarioError, match=r"\$.model: .*every parameter is frozen \(requires_grad off\): nothing"):
        load_text(text("user_gpt:frozen", "scheme: ddp, dp: 2"))


def test_a_mapping_output_read_by_attribute_keeps_its_type() -> None:
    """Hugging Face's ``ModelOutput`` is read by attribute (``tests/user_mapping.py``): the trace's marks
    keep the mapping's type, so the module reads on the meta device and ZeRO-3 gathers each module's
    parameters (before the fix: AttributeError, a one-line error)."""
    (s,) = load_text(text("user_mapping:build", "scheme: zero3, dp: 2"))
    gathers = [r for r in predict(s).collectives if r.source.startswith("ZeRO-3 module parameter all-gather")]
    assert gathers and predict(s).param_count == 8 * 8 + 8 + 8 + 1


def test_a_build_that_raises_is_one_line() -> None:
    with pytest.raises(ScenarioError) as info:  # callable, but not a build(scenario)
        load_text(text("os:getcwd", "scheme: ddp, dp: 2"))
    (problem,) = info.value.problems
    assert problem.message.startswith("model.module 'os:getcwd': build(scenario) raised TypeError: ")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("import sys\nsys.exit(0)\n", "exited (status 0); a module commgate imports must not end the process"),
        (
            "import argparse\nargparse.ArgumentParser().add_argument('--data', required=True)\n"
            "argparse.ArgumentParser().parse_args(['--nope'])\n",
            "exited (status 2, having printed ",
        ),
        ("raise RuntimeError('boom at import')\n", "raised RuntimeError: boom at import; fix the module"),
        (  # not an Exception: it went past every handler, a traceback (found by an adversarial pass)
            "class Abort(BaseException): pass\nraise Abort('stop')\n",
            "raised Abort: stop; fix the module",
        ),
    ],
    ids=["sys.exit", "argparse", "raises", "raises a BaseException"],
)
def test_a_module_that_ends_or_fails_on_import_is_one_line_naming_the_file(
    body: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module calling ``sys.exit`` on import ended ``commgate run --gate`` with status 0 and nothing run;
    one parsing its own arguments printed its usage as commgate's (found by an adversarial pass)."""
    (tmp_path / "ends_here.py").write_text(body + "def build(scenario): pass\n")
    (tmp_path / "s.yaml").write_text(text("ends_here:build", "scheme: ddp, dp: 2"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "ends_here", raising=False)
    with pytest.raises(ScenarioError) as info:
        load_file(tmp_path / "s.yaml")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 's.yaml'}:3: $.model.module: importing ends_here ") and said in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("import os\nos._exit(0)\ndef build(scenario): pass\n", "importing ends_here called os._exit (status 0)"),
        ("import os\ndef build(scenario): os._exit(3)\n", "build(scenario) called os._exit(3); build must return"),
        ("import sys\ndef build(scenario): sys.exit(2)\n", "build(scenario) called sys.exit(2); build must return"),
        (
            "class Abort(BaseException): pass\ndef build(scenario): raise Abort('stop')\n",
            "build(scenario) raised Abort: stop",
        ),
    ],
    ids=["os._exit on import", "os._exit in build", "sys.exit in build", "a BaseException in build"],
)
def test_a_module_that_ends_the_process_is_an_error_not_a_silent_exit(body: str, said: str, tmp_path: Path) -> None:
    """Found by an adversarial pass: ``os._exit`` in a module's import or its ``build`` (a training script's
    way past a hang in NCCL's teardown) ended ``commgate validate``, ``run`` and pytest's collection with the
    module's status, 0, and no word, another scenario's error beside it never said; ``sys.exit`` in ``build``
    was pytest's INTERNALERROR. Run as a command: where the guard fails, the process ends, not this test's."""
    import subprocess

    (tmp_path / "ends_here.py").write_text(body)
    (tmp_path / "s.yaml").write_text(text("ends_here:build", "scheme: ddp, dp: 2"))
    (tmp_path / "t.yaml").write_text(text("ends_here:build", "scheme: ddp, dp: -3").replace("name: u", "name: t"))
    done = subprocess.run(
        [sys.executable, "-m", "commgate", "validate", "s.yaml", "t.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert any(line.startswith("s.yaml:3: ") and said in line for line in lines), done.stderr
    assert any(line.startswith("t.yaml") for line in lines), done.stderr  # the other file's error is said too


def test_a_rank_that_ends_with_os_exit_0_in_its_step_is_the_scenarios_error(tmp_path: Path) -> None:
    """Found by an adversarial pass: a rank ended by ``os._exit(0)`` wrote no record, and the run ended in a
    FileNotFoundError traceback with no report. Now it is the scenario's error, one line, and the report is
    written. The forward ends the rank only off the meta device (the measurement at load runs on it)."""
    import json
    import subprocess

    (tmp_path / "ends_in_step.py").write_text(
        "import os\n"
        "from commgate.examples.mixer import build as mixer\n"
        "def build(scenario):\n"
        "    model, inputs = mixer(scenario)\n"
        "    forward = model.forward\n"
        "    def ending(*args, **kwargs):\n"
        "        if not next(model.parameters()).is_meta:\n"
        "            os._exit(0)\n"
        "        return forward(*args, **kwargs)\n"
        "    model.forward = ending\n"
        "    return model, inputs\n"
    )
    (tmp_path / "s.yaml").write_text(text("ends_in_step:build", "scheme: ddp, dp: 2"))
    done = subprocess.run(
        [sys.executable, "-m", "commgate", "run", "s.yaml", "--report-dir", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "a rank exited with status 0 without writing its record (rank0.meta.json" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    (s,) = json.loads((tmp_path / "out" / "report.json").read_text())["scenarios"]
    assert s["status"] == "error"


def test_a_build_that_fails_names_the_scenario_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad_build.py").write_text("def build(scenario): return 5\n")
    (tmp_path / "s.yaml").write_text(text("bad_build:build", "scheme: ddp, dp: 2"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "bad_build", raising=False)
    with pytest.raises(ScenarioError) as info:
        load_file(tmp_path / "s.yaml")
    said = f"{tmp_path / 's.yaml'}:3: $.model: model.module 'bad_build:build': build(scenario) must"
    assert str(info.value).startswith(said), str(info.value)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("scheme", ["ddp", "zero1", "zero2", "zero3"])
def test_frozen_parameters_and_buffers_reconcile_on_real_runs(scheme: str, m: int, tmp_path: Path) -> None:
    """A LoRA-style module (``tests/user_lora.py``): frozen embedding and base projections, trainable
    adapters, a float buffer cast to bf16 with the module, a boolean and an int64 buffer. Frozen parameters
    are broadcast (and under ZeRO-3 gathered) but never reduced; DDP broadcasts the buffers, by dtype, at
    construction and before each step's first forward. The difference to the paper is the named term."""
    from commgate.run.launcher import launch_local

    (s,) = load_text(
        text("user_lora:build", f"scheme: {scheme}, dp: 3, micro_batches: {m}").replace(
            'model: {module: "user_lora:build"}', 'model: {module: "user_lora:build", dtype: bf16}'
        )
    )
    prediction = predict(s)
    comparison = prediction.comparison()
    assert all(c.unexplained_bytes == 0 for c in comparison)
    assert "frozen parameters" in {r.name for c in comparison for r in c.residuals}
    broadcasts = {r.dtype for r in prediction.collectives if r.source == "DDP buffer broadcast before the forward"}
    assert broadcasts == ({"bf16", "bool", "int64"} if scheme == "ddp" else set())
    rec = reconcile(prediction, launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops) and rec.traffic_measured == rec.traffic_predicted


def test_tied_weights_of_a_users_model_are_a_named_term_and_reconcile(tmp_path: Path) -> None:
    """nanoGPT-style tying (``wte.weight = lm_head.weight``, ``tests/user_nanogpt.py``) under ZeRO-3: the
    coordinator gathers the shared weight in both holders' forward and backward; the paper comparison
    names those gathers ("shared parameters": two more gathers of V x h fp32 elements, (d-1)/d of each),
    nothing is unexplained, and a real run reconciles."""
    import user_nanogpt as nano
    from commgate.run.launcher import launch_local

    (s,) = load_text(text("user_nanogpt:build", "scheme: zero3, dp: 2").replace("}\n", ", s: 32}\n", 1))
    prediction = predict(s)
    (eq3,) = prediction.comparison()
    shared = [r for r in eq3.residuals if r.name == "shared parameters"]
    assert [r.bytes for r in shared] == [2 * nano.V * nano.H * 4 // 2]
    assert "wte.weight" in shared[0].detail and eq3.unexplained_bytes == 0
    rec = reconcile(prediction, launch_local(s, workdir=tmp_path))
    assert not rec.mismatches, rec.mismatches
    assert all(o.unexplained_bytes == 0 for o in rec.ops)


def test_what_the_module_prints_while_commgate_builds_and_traces_it_is_not_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29, item 7: a user's build that prints (as many do) printed once per prediction, between the
    run's lines; the ranks build it again and their logs keep it."""
    (tmp_path / "chatty.py").write_text(
        "import torch\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        print('building Net')\n"
        "        self.lin = torch.nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n"
        "        print('forward of Net')\n"
        "        return self.lin(x).sum()\n\n"
        "def build(scenario):\n"
        "    print('chatty build')\n"
        "    return Net(), lambda seed: (torch.randn(2, 8),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (s,) = load_text(text("chatty:build", "scheme: zero3, dp: 2"))
    assert predict(s).collectives
    out = capsys.readouterr().out
    assert "chatty build" not in out and "building Net" not in out and "forward of Net" not in out


@pytest.mark.parametrize("scheme", ["ddp", "zero3"])
def test_a_trainable_parameter_never_used_is_one_line_naming_it(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submodule the forward never calls: under ZeRO-3 a traceback (KeyError), under DDP a prediction
    whose paper term came out 20 B short, and a run DDP stopped at its second step (found by an adversarial
    pass)."""
    (tmp_path / "two_heads.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)\n"
        "    def forward(self, x):\n        return self.a(x).sum()\n\n"
        "def build(scenario):\n    return M(), lambda seed: (torch.ones(2, 4),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "two_heads", raising=False)
    with pytest.raises(ScenarioError) as info:
        load_text(text("two_heads:build", f"scheme: {scheme}, dp: 2"))
    (problem,) = info.value.problems
    assert problem.path == "$.model" and problem.message == (
        "model.module 'two_heads:build': b.weight, b.bias receive no gradient in a forward and backward (on the "
        "meta device): torch's DDP stops at the second step on a trainable parameter never used (without "
        "find_unused_parameters), and commgate does not model what the engines send for one; freeze it "
        "(requires_grad_(False)) or use it in the forward"
    )


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            "import torch\ndef build(scenario): return 42, lambda seed: (torch.ones(1),)\n",
            "build(scenario) must return (torch.nn.Module, function from a seed to the inputs), got (int, function)",
        ),
        (
            "import torch\ndef build(scenario): return torch.nn.ReLU(), lambda seed: (torch.ones(1),)\n",
            "the module has no parameters: nothing to train, nothing to communicate",
        ),
    ],
    ids=["not-a-module", "no-parameters"],
)
def test_what_a_build_returned_is_named_as_it_is(
    body: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``got tuple`` for a tuple of the wrong things, and "every parameter is frozen" for a module with none
    (found by an adversarial pass)."""
    (tmp_path / "odd_build.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "odd_build", raising=False)
    with pytest.raises(ScenarioError) as info:
        load_text(text("odd_build:build", "scheme: ddp, dp: 2"))
    (problem,) = info.value.problems
    assert problem.message == f"model.module 'odd_build:build': {said}"


def test_checkpointing_a_users_module_says_it_does_nothing() -> None:
    """The switch wraps the built-in decoder's layers; on a user's module it changed nothing, unsaid (found by
    an adversarial pass)."""
    (s,) = load_text(text(MIXER, "scheme: ddp, dp: 2, activation_checkpointing: true"))
    (said,) = [w for w in s.warnings if w.startswith("parallelism.activation_checkpointing")]
    assert f"model.module {MIXER!r} runs its own forward as written" in said
    (plain,) = load_text(text(MIXER, "scheme: ddp, dp: 2"))
    assert not [w for w in plain.warnings if w.startswith("parallelism.activation_checkpointing")]
    assert rows(predict(s)) == rows(predict(plain))  # what the warning says: nothing changes


def test_what_a_module_writes_to_descriptor_1_stays_out_of_predict_json(tmp_path: Path) -> None:
    """``os.write(1, ...)`` at import and in ``build`` (a C extension's ``printf`` alike) went into ``commgate
    predict --json``'s document, which no longer parsed (found by an adversarial pass): it goes to stderr."""
    import json
    import subprocess

    body = (
        "import os\nos.write(1, b'RAW AT IMPORT\\n')\n"
        "from commgate.examples.mixer import build as mixer\n"
        "def build(scenario):\n    os.write(1, b'RAW IN BUILD\\n')\n    return mixer(scenario)\n"
    )
    (tmp_path / "raw_writer.py").write_text(body)
    (tmp_path / "s.yaml").write_text(text("raw_writer:build", "scheme: ddp, dp: 2"))
    done = subprocess.run([sys.executable, "-m", "commgate", "predict", "--json", "s.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)
    assert "RAW AT IMPORT" in done.stderr and "RAW IN BUILD" in done.stderr
