#!/usr/bin/env bash
# The tests that start processes (ranks, forkservers, torchrun and Slurm jobs, captured jobs), run while
# busy processes keep every core loaded beside them: no test may depend on how fast the machine is.
#
#   ci/under-load.sh                          # the process-spawning test files
#   ci/under-load.sh tests/test_run.py -x     # any pytest arguments instead
#   HOGS=8 ci/under-load.sh                   # busy processes (default: two per core)
#
# The busy processes are killed however the tests end; the exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python
HOGS=${HOGS:-$((2 * $(nproc)))}
hogs=()
trap 'kill "${hogs[@]}" 2>/dev/null || true; wait' EXIT
for _ in $(seq "$HOGS"); do
  (while :; do :; done) &
  hogs+=($!)
done
echo "under load: $HOGS busy processes (${hogs[*]}) on $(nproc) cores"
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(tests/plugin tests/test_run.py tests/test_cli.py tests/test_compare.py tests/test_capture_job.py
        tests/test_capture_check.py tests/test_torchrun.py tests/test_multinode.py tests/test_emulate.py)
fi
"$PYTHON" -m pytest -q -p no:cacheprovider "${args[@]}"
