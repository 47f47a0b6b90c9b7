#!/usr/bin/env bash
# Pre-upgrade A/B: run a scenario suite on the current stack and on a candidate stack, then compare.
# Usage: ci/pre-upgrade.sh REQUIREMENT [REQUIREMENT ...]      a candidate made here from requirements
#          e.g. ci/pre-upgrade.sh deepspeed==0.18.9          (or torch==2.12.0, or a wheel path)
#        CANDIDATE=PREFIX ci/pre-upgrade.sh                  an existing virtualenv or conda prefix with
#          e.g. CANDIDATE=/opt/conda/envs/rocm6.2 ...        commgate installed (PREFIX/bin/commgate): a
#                                                            ROCm/RCCL or CUDA/NCCL stack you built
# Runs in the current directory, so it works from your own repository: SUITE (default scenarios) is the
# suite, CURRENT (default .venv) the current stack's prefix. From requirements, the candidate is
# ./.venv-candidate with the requirements and this commgate checkout; TORCH (default torch==2.13.0, the
# CPU build; set TORCH= to leave torch to the requirements or the index) unless a requirement names torch.
# Runs the suite REPEAT times on each side (default 3), interleaved (before, after, before, ...) so that
# a machine drifting in speed weighs on both sides alike: latency is judged on runs, and each side needs
# 3. Writes $OUT/before/N/report.json, $OUT/after/N/report.json and $OUT/compare.txt (default
# OUT=out/pre-upgrade) and exits with `commgate compare`'s status: 1 when communication changed.
# DRY_RUN=1 prints the commands instead of running them.
# Extra `commgate run` arguments go in RUN_ARGS (e.g. RUN_ARGS="--deadline 900").
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: ci/pre-upgrade.sh REQUIREMENT [REQUIREMENT ...]   or   CANDIDATE=PREFIX ci/pre-upgrade.sh"
OUT=${OUT:-out/pre-upgrade}
SUITE=${SUITE:-scenarios}
REPEAT=${REPEAT:-3}
CURRENT=${CURRENT:-.venv}
run() { if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
if [ -n "${CANDIDATE:-}" ]; then
  [ $# -eq 0 ] || { echo "$usage (not both)" >&2; exit 2; }
else
  [ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
fi
# the current stack before a candidate is built (minutes, gigabytes), and in a dry run too
[ -x "$CURRENT/bin/commgate" ] || {
  echo "CURRENT=$CURRENT: no $CURRENT/bin/commgate (the README's set-up makes .venv; or set CURRENT=PREFIX)" >&2; exit 2; }
if [ -n "${CANDIDATE:-}" ]; then
  [ -x "$CANDIDATE/bin/commgate" ] || [ "${DRY_RUN:-0}" = 1 ] || {
    echo "CANDIDATE=$CANDIDATE: no $CANDIDATE/bin/commgate (pip install -e $here into it first)" >&2; exit 2; }
  candidate=$CANDIDATE
else
  torch_req=${TORCH-torch==2.13.0}
  for r in "$@"; do case "$r" in torch*) torch_req="";; esac; done
  candidate=.venv-candidate
  run python3 -m venv "$candidate"
  # shellcheck disable=SC2086  # torch_req is empty or one requirement
  run "$candidate/bin/pip" install -q $torch_req "$@" -e "$here"
fi
run rm -rf "$OUT/before" "$OUT/after"
for i in $(seq 1 "$REPEAT"); do   # failures are part of the A/B
  # shellcheck disable=SC2086  # SUITE and RUN_ARGS may hold several words
  run "$CURRENT/bin/commgate" run $SUITE ${RUN_ARGS:-} --report-dir "$OUT/before/$i" || true
  # shellcheck disable=SC2086
  run "$candidate/bin/commgate" run $SUITE ${RUN_ARGS:-} --report-dir "$OUT/after/$i" || true
done
if [ "${DRY_RUN:-0}" = 1 ]; then
  run "$CURRENT/bin/commgate" compare "$OUT/before" "$OUT/after"
  exit 0
fi
status=0
"$CURRENT/bin/commgate" compare "$OUT/before" "$OUT/after" | tee "$OUT/compare.txt" || status=$?
exit $status
