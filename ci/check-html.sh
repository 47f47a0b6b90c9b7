#!/usr/bin/env bash
# The report pages, checked in a real headless browser: a planted fault fails the DDP scenario,
# and the page Chromium renders must show the findings, the obtained/expected/difference table and the
# scenario's figures; and at 2 and 16 ranks no label of any figure lies over another or over a bar
# (tests/test_html_browser.py, which the plain test command skips without Chromium).
#
#   ci/check-html.sh            # needs Chromium: apt-get install chromium (CHROMIUM=/path names another)
#
# The page, its report and a screenshot stay under out/html-check/ for a person to look at.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
rm -rf out/html-check && mkdir -p out
COMMGATE_REQUIRE_BROWSER=1 exec "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_html_browser.py \
  --basetemp out/html-check "$@"
