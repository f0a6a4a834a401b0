"""kvstorm against llama.cpp's OpenAI server: the same GGUF file, the same CPUs, the same open-loop load, one run.

llama-cpp-python is not a dependency of ours (it compiles llama.cpp: about 4 minutes on two cores); give this
script a Python that has it, e.g. a venv of its own beside ours:

    python3 -m venv .llama-venv && .llama-venv/bin/pip install 'llama-cpp-python[server]'
    .venv/bin/python scripts/bench_peer_llamacpp.py --llama-python .llama-venv/bin/python

Each server in turn (never both at once) takes `kvstorm bench serve` at each arrival rate: chat prompts from the
bundled corpus, exactly ``--output-len`` tokens per request, Poisson arrivals. llama.cpp gets every CPU as threads
and ``--interrupt_requests False`` (by default a new request cuts the stream in progress, which the load generator
counts as a broken stream); it runs the Q4_1 weights with its own quantized kernels, one request at a time.
kvstorm dequantizes them to float32 and batches every request in flight. Writes the "peer-llamacpp" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from chaos.injectors.processes import free_port
from engine.model.registry import resolve_model
from kvstorm.bench.doc import update_section
from loadgen.records import Outcome
from loadgen.results import RunResult

MODEL = "smollm2-135m"


def wait_until_up(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it answered {url}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:g} s")


def start_llamacpp(llama_python: str, port: int) -> subprocess.Popen:
    command = [llama_python, "-m", "llama_cpp.server", "--model", str(resolve_model(MODEL).path)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--model_alias", MODEL]
    command += ["--n_threads", str(os.cpu_count()), "--interrupt_requests", "False"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_up(f"http://127.0.0.1:{port}/v1/models", process)
    return process


def start_kvstorm(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvstorm", "serve", "--model", MODEL, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_up(f"http://127.0.0.1:{port}/ready", process)
    return process


def bench(port: int, rate: float, args: argparse.Namespace, results_dir: Path) -> RunResult:
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--no-progress"]
    command += ["--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, "--workload", "chat"]
    command += ["--input-len", args.input_len, "--output-len", f"fixed:{args.output_len}"]
    command += ["--arrival", f"poisson:rate={rate:g}", "--num-requests", str(args.num_requests), "--seed", "1"]
    command += ["--results-dir", str(results_dir), "--request-timeout", "600s", "--stall-timeout", "120s"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    (json_path,) = results_dir.glob("*.json")
    return RunResult.read(json_path)


def row(server: str, rate: float, result: RunResult) -> str:
    s = result.summary

    def ms(stats, name: str) -> str:
        return f"{getattr(stats, name) * 1e3:.0f}" if stats else "-"

    broken = s.num_requests - s.outcomes[Outcome.OK]
    return (
        f"| {server} | {rate:g} | {s.outcomes[Outcome.OK]} / {broken} | {s.output_token_throughput:.1f} "
        f"| {ms(s.ttft, 'p50')} / {ms(s.ttft, 'p99')} | {ms(s.tpot, 'p50')} / {ms(s.tpot, 'p99')} "
        f"| {ms(s.e2e, 'p50')} / {ms(s.e2e, 'p99')} | {s.peak_in_flight} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python[server] installed")
    parser.add_argument("--rates", default="1,2,4", help="arrival rates (requests/s), one run each per server")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", default="uniform:32-96")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    rates = [float(rate) for rate in args.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for server, start in (
            ("llama.cpp", lambda port: start_llamacpp(args.llama_python, port)),
            ("kvstorm", start_kvstorm),
        ):
            port = free_port()
            process = start(port)
            try:
                for rate in rates:
                    results_dir = Path(scratch) / f"{server}-{rate:g}"
                    rows.append(row(server, rate, bench(port, rate, args, results_dir)))
                    print(rows[-1], flush=True)
            finally:
                process.terminate()
                process.wait(60)
    markdown = "\n".join(
        [
            "## Peer: llama.cpp's OpenAI server (`scripts/bench_peer_llamacpp.py`)",
            "",
            f"The same SmolLM2-135M Q4_1 GGUF served by `kvstorm serve` (weights dequantized to float32, continuous "
            f"batching) and by llama-cpp-python's server (llama.cpp's Q4_1 kernels, {os.cpu_count()} threads, one "
            f"request at a time), one after the other on this machine's {os.cpu_count()} CPUs. Load: `kvstorm bench "
            f"serve`, chat prompts from the bundled corpus (input `{args.input_len}`), exactly {args.output_len} "
            f"output tokens, {args.num_requests} requests of Poisson arrivals per rate. Milliseconds.",
            "",
            "| server | rate req/s | ok / failed | output tok/s | TTFT p50 / p99 | TPOT p50 / p99 | E2E p50 / p99 "
            "| peak in flight |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Reproduce: `.venv/bin/python scripts/bench_peer_llamacpp.py --llama-python PYTHON --rates {args.rates}` "
            f"({time.strftime('%Y-%m-%d')})",
        ]
    )
    print(markdown)
    if not args.no_docs:
        update_section("peer-llamacpp", markdown)


if __name__ == "__main__":
    main()
