"""Report pages, opened in a real headless browser (Chromium): a planted fault fails the DDP scenario
through the pytest gate, and the page as Chromium parses and renders it shows the failure's findings, its
obtained / expected / difference table and the scenario's figures, opened; and at 2 and 16 ranks, every
label of every inline figure is laid out clear of the others and of the bars.

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


LAYOUT_CHECK = """<script>
(() => {
  const out = [];
  const hit = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1
    && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  document.querySelectorAll("svg").forEach((svg) => {
    const name = svg.getAttribute("aria-label") || "svg";
    const box = svg.getBoundingClientRect();
    const texts = [...svg.querySelectorAll("text")].map((t) => [t.firstChild.nodeValue, t.getBoundingClientRect(), t]);
    const bars = [...svg.querySelectorAll("rect")].filter((r) => r.getAttribute("fill") === null)
      .map((r) => r.getBoundingClientRect());
    texts.forEach(([a, ra, ta], i) => {
      if (ra.right > box.right + 0.5 || ra.left < box.left - 0.5) out.push(`${name}: "${a}" cut off`);
      texts.slice(i + 1).forEach(([b, rb]) => { if (hit(ra, rb)) out.push(`${name}: "${a}" over "${b}"`); });
      if (ta.getAttribute("fill") === "red" && bars.some((r) => hit(ra, r))) out.push(`${name}: "${a}" on a bar`);
    });
  });
  const labels = [...document.querySelectorAll('svg text[fill="red"]')].length;
  document.body.insertAdjacentHTML("beforeend",
    `<pre id="layout-check">${labels} ${JSON.stringify(out).replace(/</g, "&lt;")}</pre>`);
})();
</script>"""


@pytest.mark.parametrize("world", [2, 16])
def test_no_label_of_a_scenarios_figures_overlaps_another_or_a_bar_at_2_and_16_ranks(
    tmp_path: Path, world: int
) -> None:
    """Issue 29 item 9: at 16 ranks the cold-start labels were drawn over the bars (red on red) and over each
    other. A pipeline (2 stages, dp = world / 2) with a planted first-recv delay on every rank: Chromium lays
    the page out, and every text of every inline figure (timeline, histogram) is measured against every
    other text and, for the cold-start labels, every bar; each details element opened first."""
    browser = chromium()
    scenario = tmp_path / "pp.yaml"
    scenario.write_text(
        f"schema_version: 1\nname: pp{world}\nmodel: {{preset: 19M-cpu, s: 64}}\n"
        f"parallelism: {{scheme: pp, pp: 2, dp: {world // 2}, micro_batches: 2}}\nsteps: 2\n"
    )
    out = tmp_path / "report"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(scenario)]
    argv += ["--commgate-fault", "delay-first-recv=1500", "--commgate-report-dir", str(out)]
    argv += ["--commgate-baseline-dir", str(tmp_path / "baselines")]
    gate = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert "cold-start spike" in gate.stdout, gate.stdout[-3000:]
    page = (out / "index.html").read_text()
    (out / "checked.html").write_text(page.replace("</body>", LAYOUT_CHECK + "</body>"))
    dom = browse(browser, tmp_path / "profile", "--dump-dom", (out / "checked.html").as_uri())
    at = dom.rindex('<pre id="layout-check">') + len('<pre id="layout-check">')  # (the script holds the tag too)
    found = dom[at : dom.index("</pre>", at)]
    labels, problems = found.split(" ", 1)
    assert int(labels) >= world // 2, found  # the cold-start labels are there to be measured (a stage's recvs)
    assert problems == "[]", problems
