#!/usr/bin/env bash
# Wait until the vLLM server started by scripts/vllm_serve.sh answers /health (up to 600 s, about 2 minutes here).
#
#   scripts/vllm_wait.sh PORT PID LOG       # exit 1 with the end of LOG if process PID ends or time runs out
set -euo pipefail
PORT=$1 PID=$2 LOG=$3
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && exit 0
  kill -0 "$PID" 2>/dev/null || { echo "vLLM exited before it was ready; the end of $LOG:"; tail -30 "$LOG"; exit 1; }
  sleep 1
done
echo "vLLM was not ready within 600 s; the end of $LOG:"
tail -30 "$LOG"
exit 1
