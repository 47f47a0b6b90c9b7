"""The failing-scenario page, opened in a real headless browser (Chromium): a planted fault fails the DDP
scenario through the pytest gate, and the page as Chromium parses and renders it shows the failure's
findings, its obtained / expected / difference table and the scenario's figures, opened.

Skipped where no Chromium is installed (``apt-get install chromium``; ``CHROMIUM=/path`` names another);
``ci/check-html.sh`` runs it with ``COMMGATE_REQUIRE_BROWSER=1``, where a missing browser fails instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    found = shutil.which(os.environ.get("CHROMIUM", "chromium")) or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("COMMGATE_REQUIRE_BROWSER") == "1":
            pytest.fail("no Chromium found: apt-get install chromium, or set CHROMIUM=/path/to/chrome")
        pytest.skip("no Chromium installed (apt-get install chromium); ci/check-html.sh requires it")
    return found


def browse(browser: str, profile: Path, *args: str) -> str:
    run = subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_the_failing_scenario_page_shows_the_reason_and_the_diff(tmp_path: Path) -> None:
    browser = chromium()
    out = tmp_path / "report"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "scenarios/ddp.yaml"]
    gate = subprocess.run(
        [*argv, "--commgate-fault", "extra-collective", "--commgate-report-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert gate.returncode == 1, gate.stdout[-3000:]
    url = (out / "index.html").as_uri()
    dom = browse(browser, tmp_path / "profile", "--dump-dom", url)
    assert "0 passed" in dom and "1 failed" in dom and "1 scenario(s) did not pass: see Findings" in dom
    assert "every byte explained" not in dom
    findings = dom[dom.index('<h3 id="s-ddp-19m-dp4" class="bad">') :]
    findings = findings[: findings.index("</table>")]
    assert "FAIL [model] measured communication differs from the per-collective model" in findings
    assert "FAIL [baseline] communication differs from the baseline" in findings
    row = "<td>calls [steps] all_reduce fp32 4 B forward group [0, 1, 2, 3]</td><td>12</td><td>0</td><td>+12</td>"
    assert f"<td>baseline</td>{row}" in findings  # the before / after / difference table
    assert '<a href="#s-ddp-19m-dp4">failed</a>' in dom  # the table's status links to the findings
    assert '<details id="d-ddp-19m-dp4" open="">' in dom  # and the failing scenario's figures are open
    assert 'aria-label="timeline of ddp-19m-dp4"' in dom and "; difference: largest " in dom  # the extra bytes
    shot = tmp_path / "page.png"
    browse(browser, tmp_path / "profile", "--window-size=1300,2600", f"--screenshot={shot}", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
