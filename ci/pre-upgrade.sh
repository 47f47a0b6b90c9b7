#!/usr/bin/env bash
# Pre-upgrade A/B: run the default suite on the current stack and on a candidate stack, then compare.
# Usage: ci/pre-upgrade.sh REQUIREMENT [REQUIREMENT ...]
#   e.g. ci/pre-upgrade.sh deepspeed==0.18.9            (or torch==2.12.0, or a wheel path)
# The current stack is ./.venv (the README's set-up). The candidate gets its own virtual environment,
# ./.venv-candidate: torch==2.13.0 unless a torch requirement is given, the requirements, and this
# checkout. Runs the suite REPEAT times on each side (default 3), interleaved (before, after, before, ...)
# so that a machine drifting in speed weighs on both sides alike: latency is judged on runs, and each
# side needs 3. Writes $OUT/before/N/report.json, $OUT/after/N/report.json and $OUT/compare.txt
# (default OUT=out/pre-upgrade) and exits with `commgate compare`'s status: 1 when communication changed.
# DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: ci/pre-upgrade.sh REQUIREMENT [REQUIREMENT ...]" >&2; exit 2; }
OUT=${OUT:-out/pre-upgrade}
SUITE=${SUITE:-scenarios}
REPEAT=${REPEAT:-3}
torch_req="torch==2.13.0"
for r in "$@"; do case "$r" in torch*) torch_req="";; esac; done
run() { if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
[ -x .venv/bin/commgate ] || run bash -c "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ."
run python3 -m venv .venv-candidate
run .venv-candidate/bin/pip install -q $torch_req "$@" -e .
run rm -rf "$OUT/before" "$OUT/after"
for i in $(seq 1 "$REPEAT"); do   # failures are part of the A/B
  run .venv/bin/commgate run "$SUITE" --report-dir "$OUT/before/$i" || true
  run .venv-candidate/bin/commgate run "$SUITE" --report-dir "$OUT/after/$i" || true
done
if [ "${DRY_RUN:-0}" = 1 ]; then
  run .venv/bin/commgate compare "$OUT/before" "$OUT/after"
  exit 0
fi
status=0
.venv/bin/commgate compare "$OUT/before" "$OUT/after" | tee "$OUT/compare.txt" || status=$?
exit $status
