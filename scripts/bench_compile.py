"""Does torch.compile pay on the CPU decode path? The model's forward (decoder stack, LM head on each sequence's
last row) for one and for four decode streams, eager as the engine runs it against the same model compiled by
Inductor, in child processes that alternate (eager, compiled, eager, compiled: this machine's speed drifts).

- eager: the engine's CPU path: linears prepacked for oneDNN and sliced for batch invariance, RMSNorm and rotary
  embeddings through the compiled C++ layer ops.
- compiled: ``torch.compile(dynamic=True)`` of the plain model with Inductor's freezing (it prepacks the linears
  for oneDNN itself and fuses RMSNorm, rotary embeddings and residual adds into generated C++) and its C++
  wrapper. Inductor gives oneDNN every row at once: no batch-invariant slices.

Both attend through the same C++ paged-attention kernel; for Inductor it is a custom op that finds the layer's KV
cache by index, outside the graph (as vLLM does): a cache passed in as an input is copied whole by the functional
graph, every layer, every step. Each stream has a 128-token prompt, then 5 rounds of 64 greedy decode steps from
the same positions; the median round counts. The greedy tokens of both are compared.
Writes the "compile" section of docs/benchmarks.md.

    .venv/bin/python scripts/bench_compile.py [--dtypes bfloat16,float32] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from engine.model.registry import native_bfloat16_cpu_feature
from kvstorm.bench.doc import update_section
from kvstorm.bench.process import run_child

STREAMS = (1, 4)
PROMPT_LEN, DECODE_STEPS, ROUNDS, BLOCK_SIZE, BLOCKS_PER_STREAM = 128, 64, 5, 16, 16

CHILD = """
import json, statistics, sys, time, typing
import torch
from torch.library import custom_op
from engine.attention.kv_cache import PagedKVCache
from engine.model.packed_linear import set_batch_invariant
from engine.model.registry import resolve_model
from kernels.cpu_paged_attention import paged_attention_cpu
from kernels.reference import reshape_and_cache_reference

dtype, mode = getattr(torch, sys.argv[1]), sys.argv[2]
streams, prompt_len, steps, rounds, block_size, per_stream = (int(a) for a in sys.argv[3:9])
torch.set_num_threads(2)
CACHES = []

@custom_op("bench::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, slots: torch.Tensor,
           block_tables: torch.Tensor, row_seqs: torch.Tensor, row_lens: torch.Tensor, scale: float) -> torch.Tensor:
    k_cache, v_cache = CACHES[layer]
    reshape_and_cache_reference(k, v, k_cache, v_cache, slots)
    return paged_attention_cpu(q, k_cache, v_cache, block_tables, row_seqs, row_lens, scale)

@attend.register_fake
def _(q, k, v, layer, slots, block_tables, row_seqs, row_lens, scale):
    return torch.empty_like(q)

class Layout(typing.NamedTuple):
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    row_seqs: torch.Tensor
    row_lens: torch.Tensor

class CustomOpBackend:
    name = "cpu (custom op)"
    def forward(self, q, k, v, layer, layout, scale):
        return torch.ops.bench.attend(q, k, v, layer, *layout, scale)

model = resolve_model("smollm2-135m").load_model(dtype=dtype, backend=CustomOpBackend())
model.rotary.inv_freq(torch.device("cpu"))  # filled before tracing, or the first call compiles twice
cache = PagedKVCache(model.config, streams * per_stream, block_size, dtype, torch.device("cpu"))
CACHES.extend(cache.layers)
layers = list(range(len(CACHES)))

class LastRowLogits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
    def forward(self, input_ids, positions, layout, last_rows):
        return self.model.compute_logits(self.model(input_ids, positions, layers, layout)[last_rows])

forward = LastRowLogits(model)
if mode == "eager":
    model.pack_linear_weights()
    model.use_cpu_kernels()
    set_batch_invariant(model, True)
else:
    import torch._inductor.config as inductor
    inductor.freezing = True
    inductor.cpp_wrapper = True
    forward = torch.compile(forward, dynamic=True)

tables = torch.arange(streams * per_stream).view(streams, per_stream)
def run(seqs, tokens, starts):
    # Sequence seqs[i] takes tokens[i] at positions starts[i]...; the logits of each sequence's last row.
    ids, pos, slots, row_seqs, last = [], [], [], [], []
    for seq, toks, start in zip(seqs, tokens, starts):
        for p in range(start, start + len(toks)):
            pos.append(p); slots.append(int(tables[seq, p // block_size]) * block_size + p % block_size)
            row_seqs.append(seq)
        ids += toks; last.append(len(ids) - 1)
    pos = torch.tensor(pos)
    layout = Layout(torch.tensor(slots), tables, torch.tensor(row_seqs), pos + 1)
    return forward(torch.tensor(ids), pos, layout, torch.tensor(last))

with torch.inference_mode():
    start = time.perf_counter()
    first = [int(run([s], [list(range(1000 + s, 1000 + s + prompt_len))], [0]).argmax()) for s in range(streams)]
    run(list(range(streams)), [[t] for t in first], [prompt_len] * streams)
    first_calls_s = time.perf_counter() - start
    rates, tokens = [], []
    for _ in range(rounds):
        current, round_tokens = first, []
        start = time.perf_counter()
        for step in range(steps):
            logits = run(list(range(streams)), [[t] for t in current], [prompt_len + step] * streams)
            current = logits.argmax(-1).tolist()
            round_tokens.append(current[0])
        rates.append(streams * steps / (time.perf_counter() - start))
        tokens.append(round_tokens)
print("RESULT", json.dumps({"tokens_per_s": statistics.median(rates), "first_calls_s": first_calls_s,
                            "tokens": tokens[0], "rounds_agree": all(t == tokens[0] for t in tokens)}))
"""


def measure(dtype: str, mode: str, streams: int) -> dict:
    args = [PROMPT_LEN, DECODE_STEPS, ROUNDS, BLOCK_SIZE, BLOCKS_PER_STREAM]
    child = run_child([sys.executable, "-c", CHILD, dtype, mode, str(streams), *map(str, args)], timeout_s=1800)
    if child.exit_code != 0 or "RESULT " not in child.output:
        raise RuntimeError(f"{mode} {dtype} x{streams} failed:\n{child.output[-3000:]}")
    return json.loads(child.output.split("RESULT ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--runs", type=int, default=2, help="eager/compiled pairs per dtype and stream count")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        for streams in STREAMS:
            results: dict[str, list[dict]] = {"eager": [], "compiled": []}
            for _ in range(args.runs):
                for mode in results:
                    results[mode].append(result := measure(dtype, mode, streams))
                    print(
                        f"[bench compile] {dtype} x{streams} {mode}: {result['tokens_per_s']:.1f} tok/s, "
                        f"first calls {result['first_calls_s']:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            eager, compiled = ([r["tokens_per_s"] for r in results[m]] for m in ("eager", "compiled"))
            # Every round of every process, eager and compiled, decoded the same tokens.
            reference = results["eager"][0]["tokens"]
            same = all(r["rounds_agree"] and r["tokens"] == reference for rs in results.values() for r in rs)
            compile_s = " / ".join(f"{r['first_calls_s']:.0f}" for r in results["compiled"])
            rows.append(
                f"| {dtype} | {streams} | {' / '.join(f'{x:.1f}' for x in eager)} "
                f"| {' / '.join(f'{x:.1f}' for x in compiled)} "
                f"| {statistics.median(compiled) / statistics.median(eager) - 1:+.0%} | {compile_s} "
                f"| {'yes' if same else 'no'} |"
            )
    markdown = "\n".join(
        [
            "## torch.compile on the CPU decode path (`scripts/bench_compile.py`)",
            "",
            f"The model's forward for decode streams ({PROMPT_LEN}-token prompts, rounds of {DECODE_STEPS} greedy "
            f"steps, median of {ROUNDS} rounds per process), eager as the engine runs it (oneDNN-prepacked linears "
            "sliced for batch invariance, C++ layer ops) against `torch.compile(dynamic=True)` with Inductor's "
            "freezing and C++ wrapper (its own oneDNN packing, no slices, fused element-wise C++); attention through "
            "the same C++ kernel in both. Processes alternate eager, compiled; tok/s of each in order. "
            f"{platform.machine()} ({native_bfloat16_cpu_feature() or 'no native bfloat16'}), {os.cpu_count()} cores, "
            f"2 torch threads, torch {torch.__version__}. Compile s: the "
            "first calls of each compiled process (Inductor's on-disk cache serves the later ones in part).",
            "",
            "| dtype | streams | eager tok/s | compiled tok/s | compiled vs eager (medians) | compile s "
            "| same greedy tokens |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Reproduce: `.venv/bin/python scripts/bench_compile.py --dtypes {args.dtypes} --runs {args.runs}` "
            f"({time.strftime('%Y-%m-%d')})",
        ]
    )
    print(markdown)
    if not args.no_docs:
        update_section("compile", markdown)


if __name__ == "__main__":
    main()
