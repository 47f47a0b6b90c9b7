#!/usr/bin/env bash
# Fast check for pull requests that touch scenario files: validates every scenario and predicts its
# communication (no torch import, seconds on any runner). Writes $REPORT_DIR/predictions.json.
# Usage: ci/check-scenarios.sh [SCENARIO_PATH ...]     (default: what commgate validate reads here: the
# pytest configuration's commgate_scenario_dirs, else ./scenarios)
# Runs in the current directory, so it works from your own repository (COMMGATE names the commgate to run).
set -euo pipefail
COMMGATE=${COMMGATE:-commgate}
REPORT_DIR=${REPORT_DIR:-out}
"$COMMGATE" validate "$@"
"$COMMGATE" predict "$@" --report-dir "$REPORT_DIR" >/dev/null
echo "predictions written to $REPORT_DIR/predictions.json"
