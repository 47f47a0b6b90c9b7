#!/usr/bin/env bash
# Fast check for pull requests that touch scenario files: validates every scenario and predicts its
# communication (no torch import, seconds on any runner). Writes $REPORT_DIR/predictions.json.
# Usage: ci/check-scenarios.sh [SCENARIO_PATH ...]     (default: scenarios/)
set -euo pipefail
cd "$(dirname "$0")/.."
COMMGATE=${COMMGATE:-commgate}
REPORT_DIR=${REPORT_DIR:-out}
"$COMMGATE" validate "${@:-scenarios}"
"$COMMGATE" predict "${@:-scenarios}" --report-dir "$REPORT_DIR" >/dev/null
echo "predictions written to $REPORT_DIR/predictions.json"
