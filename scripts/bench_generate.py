"""Load time, decode speed and peak RSS of `kvstorm generate`, next to transformers doing the same job.

Each run is a fresh process (cold Python, warm page cache after the first run);
peak RSS is the child's ru_maxrss from wait4. Writes the "generate" section of
docs/benchmarks.md.

    .venv/bin/python scripts/bench_generate.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass

import torch

from engine.model.gguf_cache import CACHE_DIR_ENV
from kvstorm.bench.doc import update_section
from kvstorm.bench.process import run_child

PROMPT = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 64
KVSTORM_STATS = re.compile(
    r"model loaded in (?P<model>[\d.]+) s, tokenizer in (?P<tokenizer>[\d.]+) s, (engine ready in [\d.]+ s, )?"
    r"(?P<prompt>\d+) prompt \+ (?P<generated>\d+) generated tokens in (?P<generate>[\d.]+) s"
)
# The peer: transformers loading the same GGUF and generating greedily with its KV cache.
TRANSFORMERS_SCRIPT = f"""
import time, torch
from engine.model.registry import resolve_model
from transformers import AutoModelForCausalLM, AutoTokenizer
path = resolve_model("smollm2-135m").path
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
model_s = time.perf_counter() - start
start = time.perf_counter()
tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
tokenizer_s = time.perf_counter() - start
messages = [{{"role": "user", "content": {PROMPT!r}}}]
text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
start = time.perf_counter()
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens={MAX_TOKENS}, do_sample=False)
generate_s = time.perf_counter() - start
print(f"model loaded in {{model_s:.2f}} s, tokenizer in {{tokenizer_s:.2f}} s, "
      f"{{ids.shape[1]}} prompt + {{out.shape[1] - ids.shape[1]}} generated tokens in {{generate_s:.2f}} s")
"""


@dataclass
class Run:
    wall_s: float
    peak_rss_mib: float
    model_load_s: float
    tokenizer_load_s: float
    generated: int
    generate_s: float


def measure(command: list[str]) -> Run:
    run = run_child(command)
    if run.exit_code != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{run.output}")
    stats = KVSTORM_STATS.search(run.output)
    if stats is None:
        raise RuntimeError(f"no stats line in output:\n{run.output}")
    return Run(
        wall_s=run.wall_s,
        peak_rss_mib=run.peak_rss_mib,
        model_load_s=float(stats["model"]),
        tokenizer_load_s=float(stats["tokenizer"]),
        generated=int(stats["generated"]),
        generate_s=float(stats["generate"]),
    )


def median_row(name: str, runs: list[Run]) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    tokens_per_s = med([r.generated / r.generate_s for r in runs])
    return (
        f"| {name} | {med([r.model_load_s for r in runs]):.2f} | {med([r.tokenizer_load_s for r in runs]):.2f} | "
        f"{med([r.wall_s for r in runs]):.2f} | {tokens_per_s:.1f} | {med([r.peak_rss_mib for r in runs]):.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    kvstorm_cmd = [sys.executable, "-m", "kvstorm", "generate", "--chat", "--prompt", PROMPT]
    kvstorm_cmd += ["--max-tokens", str(MAX_TOKENS)]
    peer_cmd = [sys.executable, "-c", TRANSFORMERS_SCRIPT]
    with tempfile.TemporaryDirectory(prefix="kvstorm-bench-cache-") as cache:
        os.environ[CACHE_DIR_ENV] = cache  # the children's: kvstorm's first run converts the GGUF into it
        measure(peer_cmd)  # warm the page cache so every measured run reads the file from memory
        first_run = measure(kvstorm_cmd)
        kvstorm_runs = [measure(kvstorm_cmd) for _ in range(args.runs)]
        peer_runs = [measure(peer_cmd) for _ in range(args.runs)]
    table = "\n".join(
        [
            "| program | model load s | tokenizer load s | whole process s | decode tokens/s | peak RSS MiB |",
            "|---|---|---|---|---|---|",
            median_row("`kvstorm generate`, first run (converts the GGUF into the cache)", [first_run]),
            median_row("`kvstorm generate`", kvstorm_runs),
            median_row("transformers (same GGUF, `generate`)", peer_runs),
        ]
    )
    markdown = f"""## `kvstorm generate`: load time and peak memory

SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32), greedy, chat prompt
"{PROMPT}", up to {MAX_TOKENS} new tokens (stops at EOS). Medians of {args.runs} fresh
processes after one warm-up run; peak RSS is the process's `ru_maxrss`. kvstorm's first run converts the GGUF into
an empty cache directory (`engine/model/gguf_cache.py`), the others read the converted directory. Machine:
{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads.

{table}

Reproduce: `.venv/bin/python scripts/bench_generate.py --runs {args.runs}`
"""
    print(markdown)
    update_section("generate", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
