"""How long report.json and the HTML report take for a 100-scenario run, and how big the page is.

    .venv/bin/python benchmarks/report_speed.py REPORT.json [--scenarios 100]

Takes a real report (e.g. ``out/report.json`` from the README's first command), repeats its scenarios
(renamed) up to ``--scenarios``, then times writing report.json as a run does (``Report.write`` after
each scenario) and rendering the HTML (``commgate.report.htmlreport.write``: plots, trace.json,
index.html). Targets (issue 13): both under 10 s, the page (index.html and plots/) under 5 MB.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

from commgate.report import htmlreport
from commgate.report.report import Report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("--scenarios", type=int, default=100)
    a = ap.parse_args(argv)
    base = [s for s in json.loads(a.report.read_text())["scenarios"] if "capture" in s]
    docs = []
    for i in range(a.scenarios):
        s = copy.deepcopy(base[i % len(base)])
        s["name"] = f"{s['name']}#{i}"
        docs.append(s)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        report = Report(out / "report.json")
        t0 = time.perf_counter()
        for s in docs:  # as a run adds them: the file is rewritten after each scenario
            report.scenarios.append(s)
            report.write()
        t_json = time.perf_counter() - t0
        t0 = time.perf_counter()
        htmlreport.write(out, report.document())
        t_html = time.perf_counter() - t0
        page = (out / "index.html").stat().st_size + sum(p.stat().st_size for p in (out / "plots").glob("*"))
        size_json = (out / "report.json").stat().st_size
    print(
        f"{a.scenarios} scenarios: report.json written {a.scenarios} times in {t_json:.2f} s "
        f"({size_json / 2**20:.1f} MiB)"
    )
    print(f"HTML (plots, trace.json, index.html): {t_html:.2f} s; page {page / 2**20:.2f} MiB")
    return 0 if t_json < 10 and t_html < 10 and page < 5 * 2**20 else 1


if __name__ == "__main__":
    raise SystemExit(main())
