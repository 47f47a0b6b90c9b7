#!/usr/bin/env bash
# Pull-request gate: the CPU-gloo default suite through pytest, against the committed baselines.
# Usage: ci/pr-gate.sh [PYTEST_ARG ...]      e.g. ci/pr-gate.sh -n 2    (with pytest-xdist)
# Writes $OUT/junit.xml, $OUT/report.json and the HTML report ($OUT/index.html, plots/, trace.json;
# default OUT=out/pr-gate); exits with pytest's status.
# Any CI can call it after the README's set-up (python3 -m venv .venv && .venv/bin/pip install
# torch==2.13.0 -e '.[dev]').
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/pr-gate}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
exec "$PYTHON" -m pytest scenarios --junitxml "$OUT/junit.xml" --commgate-report-dir "$OUT" -p no:cacheprovider "$@"
