#!/usr/bin/env bash
# Pull-request gate: scenario files through pytest and commgate's plugin, against the committed baselines.
# Usage: ci/pr-gate.sh [PYTEST_ARG ...]      e.g. ci/pr-gate.sh -n 2    (with pytest-xdist)
# Runs in the current directory, so it works from your own repository too (path/to/commgate/ci/pr-gate.sh):
# SUITE (default scenarios) names the scenario files or folders, baselines are <rootdir>/baselines.
# Writes $OUT/junit.xml, $OUT/report.json and the HTML report ($OUT/index.html, plots/, trace.json;
# default OUT=out/pr-gate); exits with pytest's status. PYTHON is the interpreter with commgate installed
# (default ./.venv/bin/python, the README's set-up, else python3).
set -euo pipefail
OUT=${OUT:-out/pr-gate}
SUITE=${SUITE:-scenarios}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import commgate" 2>/dev/null; then
  echo "ci/pr-gate.sh: $PYTHON has no commgate installed; set PYTHON=/path/to/venv/bin/python (the one you installed commgate into) or activate that environment" >&2
  exit 2
fi
mkdir -p "$OUT"
# shellcheck disable=SC2086  # SUITE may name several paths
exec "$PYTHON" -m pytest $SUITE --junitxml "$OUT/junit.xml" --commgate-report-dir "$OUT" -p no:cacheprovider "$@"
