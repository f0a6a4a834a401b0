"""``kvstorm bench compile``: does torch.compile pay on the CPU decode path? The model's forward (decoder stack, LM head
on each sequence's last row) for one and for four decode streams, eager as the engine runs it against the same model
compiled by Inductor, in child processes that alternate (eager, compiled, eager, compiled: this machine's speed
drifts).

- eager: the engine's CPU path: linears prepacked for oneDNN and sliced for batch invariance, RMSNorm and rotary
  embeddings through the compiled C++ layer ops.
- compiled: ``torch.compile(dynamic=True)`` of the plain model with Inductor's freezing (it prepacks the linears
  for oneDNN itself and fuses RMSNorm, rotary embeddings and residual adds into generated C++) and its C++
  wrapper. Inductor gives oneDNN every row at once: no batch-invariant slices.

Both attend through the same C++ paged-attention kernel; for Inductor it is a custom op that finds the layer's KV
cache by index, outside the graph (as vLLM does): a cache passed in as an input is copied whole by the functional
graph, every layer, every step. Each stream has a 128-token prompt, then 5 rounds of 64 greedy decode steps from
the same positions; the median round counts. The greedy tokens of both are compared.

    kvstorm bench compile [--dtypes bfloat16,float32] [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.model.registry import native_bfloat16_cpu_feature
from kvstorm.bench.child import run_in_child
from kvstorm.bench.doc import BenchReport

STREAMS = (1, 4)
PROMPT_LEN, DECODE_STEPS, ROUNDS, BLOCK_SIZE, BLOCKS_PER_STREAM = 128, 64, 5, 16, 16


@dataclass(frozen=True)
class DecodeRounds:
    """One process's measurement: decode tok/s (median round), the first calls' seconds (compilation, for the
    compiled model), the first round's greedy tokens of stream 0, and whether every round decoded the same."""

    tokens_per_s: float
    first_calls_s: float
    tokens: list[int]
    rounds_agree: bool


def decode_rounds(dtype: str, mode: str, streams: int) -> DecodeRounds:
    """In a child process (``kvstorm.bench.child``): ``mode`` "eager" (the engine's CPU path) or "compiled"."""
    from torch.library import custom_op

    from engine.attention.kv_cache import PagedKVCache
    from engine.model.packed_linear import set_batch_invariant
    from engine.model.registry import resolve_model
    from kernels.cpu_paged_attention import paged_attention_cpu
    from kernels.reference import reshape_and_cache_reference

    torch.set_num_threads(2)
    caches = []

    @custom_op("bench::attend", mutates_args=())
    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        row_seqs: torch.Tensor,
        row_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = caches[layer]
        reshape_and_cache_reference(k, v, k_cache, v_cache, slots)
        return paged_attention_cpu(q, k_cache, v_cache, block_tables, row_seqs, row_lens, scale)

    @attend.register_fake
    def _(q, k, v, layer, slots, block_tables, row_seqs, row_lens, scale):
        return torch.empty_like(q)

    class CustomOpBackend:
        name = "cpu (custom op)"
        fuses_into_decoder_layer = False

        def forward(self, q, k, v, layer, layout, scale):
            return torch.ops.bench.attend(q, k, v, layer, *layout, scale)

    model = resolve_model("smollm2-135m").load_model(dtype=getattr(torch, dtype), backend=CustomOpBackend())
    model.rotary.inv_freq(torch.device("cpu"))  # filled before tracing, or the first call compiles twice
    cache = PagedKVCache(model.config, streams * BLOCKS_PER_STREAM, BLOCK_SIZE, getattr(torch, dtype), "cpu")
    caches.extend(cache.layers)
    layers = list(range(len(caches)))

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
    tables = torch.arange(streams * BLOCKS_PER_STREAM).view(streams, BLOCKS_PER_STREAM)

    def run(seqs, tokens, starts):
        # Sequence seqs[i] takes tokens[i] at positions starts[i]...; the logits of each sequence's last row.
        ids, pos, slots, row_seqs, last = [], [], [], [], []
        for seq, toks, start in zip(seqs, tokens, starts, strict=True):
            for p in range(start, start + len(toks)):
                pos.append(p)
                slots.append(int(tables[seq, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
                row_seqs.append(seq)
            ids += toks
            last.append(len(ids) - 1)
        pos = torch.tensor(pos)
        layout = _Layout(torch.tensor(slots), tables, torch.tensor(row_seqs), pos + 1)
        return forward(torch.tensor(ids), pos, layout, torch.tensor(last))

    with torch.inference_mode():
        start = time.perf_counter()
        prompts = [list(range(1000 + s, 1000 + s + PROMPT_LEN)) for s in range(streams)]
        first = [int(run([s], [prompts[s]], [0]).argmax()) for s in range(streams)]
        run(list(range(streams)), [[t] for t in first], [PROMPT_LEN] * streams)
        first_calls_s = time.perf_counter() - start
        rates, tokens = [], []
        for _ in range(ROUNDS):
            current, round_tokens = first, []
            start = time.perf_counter()
            for step in range(DECODE_STEPS):
                logits = run(list(range(streams)), [[t] for t in current], [PROMPT_LEN + step] * streams)
                current = logits.argmax(-1).tolist()
                round_tokens.append(current[0])
            rates.append(streams * DECODE_STEPS / (time.perf_counter() - start))
            tokens.append(round_tokens)
    return DecodeRounds(statistics.median(rates), first_calls_s, tokens[0], all(t == tokens[0] for t in tokens))


class _Layout(NamedTuple):
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    row_seqs: torch.Tensor
    row_lens: torch.Tensor


def add_bench_compile_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compile", help="torch.compile against the engine's eager CPU decode path")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--runs", type=int, default=2, help="eager/compiled pairs per dtype and stream count")


def run_bench_compile(args: argparse.Namespace) -> BenchReport:
    rows = []
    for dtype in args.dtypes.split(","):
        for streams in STREAMS:
            results: dict[str, list[DecodeRounds]] = {"eager": [], "compiled": []}
            for _ in range(args.runs):
                for mode in results:
                    result = run_in_child(decode_rounds, DecodeRounds, 1800, dtype=dtype, mode=mode, streams=streams)
                    results[mode].append(result)
                    print(
                        f"[bench compile] {dtype} x{streams} {mode}: {result.tokens_per_s:.1f} tok/s, "
                        f"first calls {result.first_calls_s:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            eager, compiled = ([r.tokens_per_s for r in results[m]] for m in ("eager", "compiled"))
            # Every round of every process, eager and compiled, decoded the same tokens.
            reference = results["eager"][0].tokens
            same = all(r.rounds_agree and r.tokens == reference for rs in results.values() for r in rs)
            compile_s = " / ".join(f"{r.first_calls_s:.0f}" for r in results["compiled"])
            rows.append(
                f"| {dtype} | {streams} | {' / '.join(f'{x:.1f}' for x in eager)} "
                f"| {' / '.join(f'{x:.1f}' for x in compiled)} "
                f"| {statistics.median(compiled) / statistics.median(eager) - 1:+.0%} | {compile_s} "
                f"| {'yes' if same else 'no'} |"
            )
    markdown = "\n".join(
        [
            f"torch.compile on the CPU decode path: the model's forward for decode streams ({PROMPT_LEN}-token "
            f"prompts, rounds of {DECODE_STEPS} greedy steps, median of {ROUNDS} rounds per process), eager as the "
            "engine runs it (oneDNN-prepacked linears sliced for batch invariance, C++ layer ops) against "
            "`torch.compile(dynamic=True)` with Inductor's freezing and C++ wrapper (its own oneDNN packing, no "
            "slices, fused element-wise C++); attention through the same C++ kernel in both. Processes alternate "
            f"eager, compiled; tok/s of each in order. {platform.machine()} "
            f"({native_bfloat16_cpu_feature() or 'no native bfloat16'}), {os.cpu_count()} cores, 2 torch threads, "
            f"torch {torch.__version__}. Compile s: the first calls of each compiled process (Inductor's on-disk "
            "cache serves the later ones in part).",
            "",
            "| dtype | streams | eager tok/s | compiled tok/s | compiled vs eager (medians) | compile s "
            "| same greedy tokens |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    return BenchReport(markdown)
