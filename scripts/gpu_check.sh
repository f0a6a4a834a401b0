#!/usr/bin/env bash
# One prepared run for a GPU machine: kernel correctness on CUDA, the kernel benchmark, and the engine's offline
# benchmark on a random-weight Llama-3-8B-shaped model in bfloat16 with the triton and the torch backends.
#
#   scripts/gpu_check.sh RESULTS_DIR        (PYTHON=... to pick the interpreter; needs torch with CUDA, triton)
#
# Every stage has its own time limit (together under 8 minutes) and writes its log and JSON under RESULTS_DIR;
# a failing stage does not stop the others, and the exit status says whether all passed.
set -u
results=${1:?usage: scripts/gpu_check.sh RESULTS_DIR}
mkdir -p "$results"
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
failed=()

stage() {  # stage NAME SECONDS LOG COMMAND...
    local name=$1 seconds=$2 log=$3
    shift 3
    echo "== $name (limit ${seconds}s)" | tee -a "$results/$log"
    local start=$SECONDS
    timeout --kill-after=10 "$seconds" "$@" >>"$results/$log" 2>&1
    local status=$?
    echo "== $name: exit $status after $((SECONDS - start))s" | tee -a "$results/$log"
    [ "$status" -eq 0 ] || failed+=("$name")
}

{
    nvidia-smi
    "$python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
} >"$results/env.txt" 2>&1

stage "kernel correctness" 100 check.log "$python" -m kernels.check --device cuda --json "$results/check.json"
stage "kernel benchmark" 170 bench.log "$python" -m kernels.bench --device cuda --json "$results/bench.json"
for backend in triton torch; do
    stage "engine offline ($backend)" 90 engine.log "$python" -m kvstorm bench --no-docs offline \
        --model random:llama3-8b --dtype bfloat16 --device cuda --attention-backend "$backend" \
        --kv-cache-memory 16GiB --static-batch-sizes '' --no-continuous --timeout 80 \
        --json "$results/engine-$backend.json"
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
