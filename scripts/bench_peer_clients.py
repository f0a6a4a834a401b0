"""kvstorm's load generator beside AIPerf and GuideLLM, the benchmark clients of the field, on the same workload:

- against one ``kvstorm serve``: each must finish with zero errors, and their TTFT and per-request inter-token
  time should agree with kvstorm's within run-to-run noise (kvstorm runs first and last, which measures it);
- against the scripted server (``loadgen.scripted_server``: first token 150 ms after a request arrives, then one
  every 20 ms), where the truth is known, so each client's error is its own.

    python3 -m venv ~/venvs/aiperf && ~/venvs/aiperf/bin/pip install aiperf
    python3 -m venv ~/venvs/guidellm && ~/venvs/guidellm/bin/pip install guidellm
    .venv/bin/python scripts/bench_peer_clients.py --aiperf ~/venvs/aiperf/bin/aiperf \\
        --guidellm ~/venvs/guidellm/bin/guidellm            # records the table in docs/benchmarks.md

Workload: chat completions, streaming, ignore_eos, ~128-token prompts of each client's own synthetic text,
exactly 32 output tokens, 2 requests in flight (closed loop), 24 requests per client, greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from chaos.injectors.processes import kvstorm_server
from engine.model.registry import resolve_model
from kvstorm.bench.doc import update_section
from loadgen.scripted_server import ServerScript, scripted_server_process

MODEL = "smollm2-135m"
PROMPT_TOKENS, OUTPUT_TOKENS, CONCURRENCY, REQUESTS = 128, 32, 2, 24


def run_kvstorm(url: str, out: Path) -> dict:
    results = out / "kvstorm"
    command = [sys.executable, "-m", "kvstorm", "bench", "--no-docs", "serve", "--base-url", url, "--model", MODEL,
               "--workload", "chat", "--input-len", f"fixed:{PROMPT_TOKENS}", "--output-len", f"fixed:{OUTPUT_TOKENS}",
               "--arrival", "constant:rate=1000", "--num-requests", str(REQUESTS), "--max-concurrency",
               str(CONCURRENCY), "--results-dir", str(results), "--no-progress"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    summary = json.loads(max(results.glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())["summary"]
    per_request_itl = _kvstorm_itl(results)
    return {
        "ok": summary["outcomes"]["ok"],
        "errors": summary["num_requests"] - summary["outcomes"]["ok"],
        "ttft_ms": (summary["ttft"]["p50"] * 1e3, summary["ttft"]["p90"] * 1e3),
        "itl_ms": (statistics.median(per_request_itl), _p90(per_request_itl)),
    }


def _kvstorm_itl(results: Path) -> list[float]:
    """Each ok request's mean gap between tokens (what AIPerf and GuideLLM call inter-token latency), ms."""
    records = json.loads(max(results.glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())["records"]
    return [statistics.mean(r["itl_s"]) * 1e3 for r in records if r["outcome"] == "ok" and r["itl_s"]]


def run_aiperf(aiperf: str, url: str, tokenizer: Path, artifacts: Path) -> dict:
    command = [aiperf, "profile", "--url", url, "--model", MODEL, "--endpoint-type", "chat", "--streaming",
               "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
               "--synthetic-input-tokens-mean", str(PROMPT_TOKENS), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
               "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0", "--tokenizer", str(tokenizer),
               # Token counts from the server's usage, as kvstorm counts them; by default AIPerf re-tokenizes the text.
               "--use-server-token-count",
               "--artifact-dir", str(artifacts), "--ui-type", "none"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    export = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    ok = int(export["request_count"]["avg"])
    errors = int((export.get("error_request_count") or {}).get("avg", 0))
    ttft, itl = export["time_to_first_token"], export["inter_token_latency"]
    return {"ok": ok, "errors": errors, "ttft_ms": (ttft["p50"], ttft["p90"]), "itl_ms": (itl["p50"], itl["p90"])}


def run_guidellm(guidellm: str, url: str, tokenizer: Path, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "guidellm.json"
    command = [guidellm, "run", "--backend", f"kind=openai_http,target={url},model={MODEL},validate_backend=false",
               "--profile", f"kind=concurrent,streams={CONCURRENCY}",
               "--constraint", f"kind=max_requests,count={REQUESTS}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={report}",
               "--disable-console-interactive"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]

    def p50_p90(name: str) -> tuple[float, float]:
        percentiles = metrics[name]["successful"]["percentiles"]
        return percentiles["p50"], percentiles["p90"]

    # GuideLLM's time_per_output_token is the whole request over its tokens (TTFT included); its inter-token
    # latency is each request's mean gap, as the others report it.
    return {"ok": totals["successful"], "errors": totals["errored"] + totals["incomplete"],
            "ttft_ms": p50_p90("time_to_first_token_ms"), "itl_ms": p50_p90("inter_token_latency_ms")}  # fmt: skip


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def run_clients(args: argparse.Namespace, url: str, tokenizer: Path, out: Path) -> list[tuple[str, dict]]:
    rows = [("kvstorm bench serve (first)", run_kvstorm(url, out / "first"))]
    rows.append(("AIPerf " + _version(args.aiperf), run_aiperf(args.aiperf, url, tokenizer, out / "aiperf")))
    rows.append(("GuideLLM " + _version(args.guidellm), run_guidellm(args.guidellm, url, tokenizer, out / "guidellm")))
    rows.append(("kvstorm bench serve (last)", run_kvstorm(url, out / "last")))
    return rows


def table(rows: list[tuple[str, dict]], truth: ServerScript | None = None) -> list[str]:
    lines = ["| client | ok | errors | TTFT p50 / p90 (ms) | inter-token p50 / p90 (ms) |", "|---|---|---|---|---|"]
    if truth is not None:
        lines[0] = lines[0].removesuffix(" |") + " | error of the p50s against the script (ms) |"
        lines[1] += "---|"
    for name, row in rows:
        line = (
            f"| {name} | {row['ok']} | {row['errors']} | {row['ttft_ms'][0]:.1f} / {row['ttft_ms'][1]:.1f} | "
            f"{row['itl_ms'][0]:.1f} / {row['itl_ms'][1]:.1f} |"
        )
        if truth is not None:
            line += (
                f" TTFT {row['ttft_ms'][0] - truth.ttft_ms:+.1f}, inter-token {row['itl_ms'][0] - truth.gap_ms:+.1f} |"
            )
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aiperf", required=True, help="the aiperf executable (its own venv)")
    parser.add_argument("--guidellm", required=True, help="the guidellm executable (its own venv)")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    script = ServerScript()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        tokenizer = out / "tokenizer"
        resolve_model(MODEL).load_tokenizer().hf_tokenizer.save_pretrained(tokenizer)
        with scripted_server_process("--ttft-ms", str(script.ttft_ms), "--gap-ms", str(script.gap_ms)) as scripted:
            yardstick = run_clients(args, scripted.base_url, tokenizer, out / "scripted")
        with kvstorm_server(["--kv-cache-memory", "256MiB"], out / "server.log") as kvstorm:
            engine = run_clients(args, kvstorm.url, tokenizer, out / "engine")
    lines = [
        f"Each client in turn: chat completions, streaming, ignore_eos, ~{PROMPT_TOKENS}-token prompts of the "
        f"client's own synthetic text, {OUTPUT_TOKENS} output tokens, {CONCURRENCY} in flight, {REQUESTS} requests. "
        "Inter-token time: each request's mean gap (AIPerf's inter_token_latency with --use-server-token-count, "
        "GuideLLM's inter_token_latency, kvstorm's mean of its gaps). Without --use-server-token-count AIPerf divides "
        "by its own re-tokenization of the text (7.3 ms against the script's 20 here), and GuideLLM's "
        "time_per_output_token includes the TTFT (24.1 ms).",
        "",
        f"Against the scripted server (first token {script.ttft_ms:g} ms after a request arrives, then one every "
        f"{script.gap_ms:g} ms; the truth):",
        "",
        *table(yardstick, script),
        "",
        "Against `kvstorm serve` (bundled model, CPU, 256 MiB KV); kvstorm's client first and last, which shows the "
        "run-to-run spread:",
        "",
        *table(engine),
    ]
    markdown = "## Peer benchmark clients\n\n" + "\n".join(lines)
    markdown += "\n\nReproduce: `.venv/bin/python scripts/bench_peer_clients.py --aiperf AIPERF --guidellm GUIDELLM`"
    print(markdown)
    if not args.no_docs:
        update_section("peer-clients", markdown)
    return 1 if any(row["errors"] for _, row in yardstick + engine) else 0


def _version(executable: str) -> str:
    result = subprocess.run([executable, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.strip().split()[-1] if result.stdout.strip() else ""


if __name__ == "__main__":
    sys.exit(main())
