"""``kvstorm generate`` and ``kvstorm serve``, and the engine's argument group (shared with ``bench offline``)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from engine.attention.selector import BACKENDS
from engine.core.admission import AdmissionLimits
from engine.core.config import (
    INVARIANT_ROWS,
    MATMUL_KERNELS,
    CacheConfig,
    EngineConfig,
    PreemptionMode,
    SchedulerConfig,
)
from engine.core.outputs import EngineInfo
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.serving.async_engine import AsyncEngine
from engine.serving.metrics import EngineMetrics
from engine.serving.server import ASYNC_ENGINE, ServerConfig, create_app, drain, start_server
from kvstorm.admission_options import add_admission_arguments, admission_limits, describe_admission
from kvstorm.exposure import committed_token_refusal

ADMIN_TOKEN_ENV = "KVSTORM_ADMIN_TOKEN"

DEFAULT_MODEL = "smollm2-135m"
_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B?|B)?", re.IGNORECASE)
_UNITS = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'512MiB', '1.5GiB', '4096' -> bytes (binary units whether or not the 'i' is written)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 512MiB, 2GiB)")
    unit = (match["unit"] or "B").upper()[0]
    return int(float(match["number"]) * _UNITS[unit])


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults_cache, defaults_sched = CacheConfig(), SchedulerConfig()
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL, help="alias, .gguf file, HF directory or random:<preset>")
    group.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA and on CPUs with native bfloat16, e.g. AVX512-BF16; float32 elsewhere), float32, "
        "bfloat16",
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    group.add_argument("--attention-backend", choices=BACKENDS, default="auto")
    group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: model's)")
    group.add_argument("--block-size", type=int, default=defaults_cache.block_size, help="tokens per KV block")
    group.add_argument("--kv-cache-memory", type=parse_bytes, default="1GiB", help="device KV pool budget")
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="device KV pool in blocks, whatever the dtype (instead of --kv-cache-memory)",
    )
    group.add_argument("--swap-space", type=parse_bytes, default="1GiB", help="host swap pool budget")
    group.add_argument("--watermark", type=float, default=defaults_cache.watermark)
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full instead of sharing the KV blocks of a prefix already computed",
    )
    group.add_argument("--max-num-seqs", type=int, default=defaults_sched.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults_sched.max_num_batched_tokens)
    group.add_argument("--no-chunked-prefill", action="store_true", help="schedule prompts whole")
    group.add_argument(
        "--max-prefill-tokens-beside-decodes",
        type=_positive_int,
        default=defaults_sched.max_prefill_tokens_beside_decodes,
        help="with chunked prefill, the prompt tokens a step computes while it also decodes (a step with no decode "
        "takes --max-num-batched-tokens): a long prompt is spread over short steps instead of stalling every "
        "stream for one long one",
    )
    group.add_argument(
        "--no-batch-invariance",
        action="store_true",
        help="let oneDNN's CPU matmuls take a step's rows at once: faster where their kernels change with the row "
        "count, but a request's tokens may then depend on what else ran in its step (kvstorm's tile matmuls "
        "are invariant at any row count)",
    )
    group.add_argument(
        "--invariant-rows",
        choices=INVARIANT_ROWS,
        default=EngineConfig.invariant_rows,
        help="where oneDNN's matmul kernels agree in more than one range of row counts (bfloat16 on CPUs with AMX, "
        "with --matmul-kernel onednn), the one batch-invariant matmuls take: throughput (the widest: big batches in "
        "few calls) or latency (a lone decode is not padded; each weight is packed in the oneDNN layout whose range "
        "for a lone row spans most counts: on AMX in bfloat16, 1 to 144-256 rows)",
    )
    group.add_argument(
        "--matmul-kernel",
        choices=MATMUL_KERNELS,
        default=EngineConfig.matmul_kernel,
        help="what multiplies the CPU's linear layers: auto (kvstorm's tile matmuls for bfloat16 on CPUs with AMX or "
        "AVX512-BF16, batch-invariant at any row count; oneDNN elsewhere) or onednn",
    )
    group.add_argument(
        "--cpu-threads",
        type=_positive_int,
        default=None,
        help="the CPU threads a step runs on (default: torch's count, fewer while other processes take a core of "
        "this process's CPUs, read from /proc/stat every quarter second; the results are the same bits at any count)",
    )
    group.add_argument(
        "--preemption-mode", choices=[m.value for m in PreemptionMode], default=defaults_sched.preemption_mode.value
    )
    group.add_argument("--debug-invariants", action="store_true", help="check block invariants after every step")
    group.add_argument("--seed", type=int, default=0, help="seed for random weights and unseeded sampling")


def engine_options_from_args(args: argparse.Namespace) -> dict[str, object]:
    """The engine group's values as flat, JSON-able options (``EngineConfig.from_options``, ``LLM(**options)``)."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "attention_backend": args.attention_backend,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "num_kv_blocks": args.num_kv_blocks,
        "swap_space": args.swap_space,
        "watermark": args.watermark,
        "enable_prefix_caching": not args.no_prefix_caching,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_chunked_prefill": not args.no_chunked_prefill,
        "max_prefill_tokens_beside_decodes": args.max_prefill_tokens_beside_decodes,
        "batch_invariant": not args.no_batch_invariance,
        "invariant_rows": args.invariant_rows,
        "matmul_kernel": args.matmul_kernel,
        "cpu_threads": args.cpu_threads,
        "preemption_mode": args.preemption_mode,
        "debug_invariants": args.debug_invariants,
        "seed": args.seed,
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_options(**engine_options_from_args(args))


def _device(info: EngineInfo) -> str:
    """The device, with the instruction set and threads on the CPU: "cpu (instruction set capped at avx2 ...; 2 CPU
    threads, ...)"."""
    details = "; ".join(detail for detail in (info.instruction_set, info.cpu_threads) if detail)
    return f"{info.device} ({details})" if details else info.device


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    add_engine_arguments(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="makes sampling reproducible")
    parser.set_defaults(handler=run_generate, kv_cache_memory=parse_bytes("256MiB"), swap_space=0)


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.sampling_seed,
    )
    start = time.perf_counter()
    engine = LLMEngine.from_config(engine_config_from_args(args))
    load_s = time.perf_counter() - start
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError(f"{args.model!r} has no tokenizer; generate needs text")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    request = engine.add_request(prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
    generate_s = time.perf_counter() - start
    sys.stdout.write("\n")
    print(
        f"[{args.model} on {_device(engine.info)} {engine.info.dtype} ({engine.info.dtype_choice}): "
        f"model loaded in {engine.load_timings['model_s']:.2f} s, tokenizer in "
        f"{engine.load_timings['tokenizer_s']:.2f} s, engine ready in {load_s:.2f} s, "
        f"{request.num_prompt_tokens} prompt + {request.num_output_tokens} generated tokens in {generate_s:.2f} s "
        f"({request.num_output_tokens / generate_s:.1f} tokens/s), "
        f"finish reason {request.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible streaming server (aiohttp)")
    add_engine_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    server.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    server.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    server.add_argument("--max-body-size", type=parse_bytes, default="1MiB", help="larger bodies get 413")
    server.add_argument(
        "--stall-timeout", type=float, default=30.0, help="/health is 503 after this long in flight without a step"
    )
    server.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or SIGINT: /ready turns 503, new requests get 503, and the streams in flight get this many "
        "seconds to finish before the rest end with an error event (a second signal ends the wait)",
    )
    server.add_argument(
        "--max-connections",
        type=int,
        default=ServerConfig.max_connections,
        help="beyond this many requests in progress a request gets 503 (idle connections do not count)",
    )
    server.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=ServerConfig.max_connections_per_peer,
        help="open connections from one address, idle ones included; beyond it a new connection gets 503 and is "
        "closed (raise it behind a proxy, or for a load generator on one host)",
    )
    server.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=ServerConfig.max_sequences,
        help="prompts x n of one completion request (more: a 400; default OpenAI's bound on n); admission counts "
        "each sequence as a request, so under load a request of many gets a 429",
    )
    server.add_argument(
        "--admin-token",
        default=os.environ.get(ADMIN_TOKEN_ENV),
        help=f"enables /admin/* behind this bearer token (default: ${ADMIN_TOKEN_ENV})",
    )
    server.add_argument(
        "--admin-exit",
        action="store_true",
        help="POST /admin/exit (with the admin token) ends the process as SIGKILL or SIGTERM would, for a supervisor "
        "that starts it again (compose's restart policy): how kill-and-restart kills a server it did not start",
    )
    server.add_argument(
        "--strict-api",
        action="store_true",
        help="refuse unknown request fields with a 400 (default: ignore them, as vLLM does, and name them in the "
        "X-Kvstorm-Ignored-Fields response header)",
    )
    server.add_argument(
        "--histogram-buckets",
        type=_float_list,
        default=(),
        help="extra latency bucket boundaries in seconds, comma-separated (e.g. SLO thresholds)",
    )
    add_admission_arguments(parser).add_argument(
        "--max-buffered-outputs",
        type=int,
        default=AdmissionLimits().max_buffered_outputs,
        help="a stream whose client leaves this many outputs unread is aborted",
    )
    parser.set_defaults(handler=run_serve)


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None


def run_serve(args: argparse.Namespace) -> int:
    # Before the model loads: a committed token never guards a port reachable beyond the machine (kvstorm/exposure.py).
    refusal = committed_token_refusal("kvstorm serve", args.host, args.admin_token, "--admin-token", ADMIN_TOKEN_ENV)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if args.admin_exit and not args.admin_token:
        print(
            f"kvstorm serve: --admin-exit needs an admin token (--admin-token or ${ADMIN_TOKEN_ENV})", file=sys.stderr
        )
        return 2
    config = ServerConfig(
        served_model_name=args.served_model_name or args.model,
        max_body_bytes=args.max_body_size,
        stall_timeout_s=args.stall_timeout,
        admin_token=args.admin_token,
        admin_exit=args.admin_exit,
        strict_api=args.strict_api,
        max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer,
        max_sequences=args.max_sequences_per_request,
    )
    limits = admission_limits(args, max_buffered_outputs=args.max_buffered_outputs)
    engine = _load_off_the_main_thread(engine_config_from_args(args))
    _freeze_the_loaded_heap()
    info = engine.info
    print(
        f"kvstorm serve: {info.model} on {_device(info)} in {info.dtype} ({info.dtype_choice}), "
        f"attention {info.attention_backend}, matmuls {info.matmul}, norms and rotary {info.layer_ops}, "
        f"KV blocks of {info.block_size} tokens ({info.bytes_per_block} bytes each)",
        file=sys.stderr,
        flush=True,
    )
    print(f"kvstorm serve: admission {describe_admission(limits)}", file=sys.stderr, flush=True)
    metrics = EngineMetrics(config.served_model_name, args.histogram_buckets)
    app = create_app(AsyncEngine(engine, metrics, limits), config)
    asyncio.run(_serve_until_signalled(app, args.host, args.port, args.drain_timeout))
    return 0


def _freeze_the_loaded_heap() -> None:
    """Move every object the start-up made (the model's modules, the tokenizer's vocabulary, the imported libraries)
    out of the garbage collector's reach, as vLLM does after its start-up (``freeze_gc_heap``). A full collection
    walks every tracked object while holding the GIL: with the loaded heap in it, one took 140-190 ms under load
    (``gc.callbacks``, SmolLM2 in float32 on a 2-core Xeon), and every stream waited that long."""
    gc.collect()
    gc.freeze()


def _load_off_the_main_thread(config: EngineConfig) -> LLMEngine:
    """The engine, loaded (weights packed, start-up measurements run) on a thread that then exits.

    Every thread that runs a parallel torch operator keeps its own OpenMP worker pool for life, and libgomp stops
    spin-waiting once its workers outnumber the cores: each operator of the engine loop's thread would then wake its
    workers through the kernel. A main thread that loaded the engine would keep such a pool: on 2 cores a
    single-stream bfloat16 decode step took 29 ms in the server against 16 ms offline (docs/benchmarks.md,
    "Serving speed").
    """
    with ThreadPoolExecutor(1, thread_name_prefix="engine-load") as loader:
        return loader.submit(LLMEngine.from_config, config).result()


async def _serve_until_signalled(app, host: str, port: int, drain_timeout_s: float) -> None:
    """Serve until SIGTERM or SIGINT, then drain: the streams in flight finish (up to ``drain_timeout_s``, or until a
    second signal), new requests are refused; then the listener closes and what is left ends with an error event."""
    runner, bound_port = await start_server(app, host, port)
    print(f"kvstorm serve: listening on http://{host}:{bound_port}", file=sys.stderr, flush=True)
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, signalled.set)
    try:
        await signalled.wait()
        signalled.clear()
        print(f"kvstorm serve: draining (up to {drain_timeout_s:g} s)", file=sys.stderr, flush=True)
        draining = asyncio.ensure_future(drain(app, drain_timeout_s))
        second_signal = asyncio.ensure_future(signalled.wait())
        await asyncio.wait([draining, second_signal], return_when=asyncio.FIRST_COMPLETED)
        second_signal.cancel()
        left = draining.result() if draining.done() else app[ASYNC_ENGINE].num_in_flight
        draining.cancel()
        print(f"kvstorm serve: stopping; {left} streams still in flight end now", file=sys.stderr, flush=True)
    finally:
        await runner.cleanup()
