"""Engine subcommands of the ``kvstorm`` command line."""

from __future__ import annotations

import argparse
import sys
import time

from engine.generate import generate_token_ids
from engine.model.registry import resolve_device, resolve_dtype, resolve_model
from engine.model.tokenizer import IncrementalDetokenizer
from engine.model_runner import ModelRunner
from engine.sampling import SamplingParams

DEFAULT_MODEL = "smollm2-135m"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="alias, .gguf file, HF directory or random:<preset>")
    parser.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    start = time.perf_counter()
    source = resolve_model(args.model)
    model = source.load_model(dtype=dtype, device=device)
    model_load_s = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = source.load_tokenizer()
    tokenizer_load_s = time.perf_counter() - start
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    num_blocks = -(-(len(prompt_ids) + params.max_tokens) // args.block_size)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=args.block_size)
    detokenizer = IncrementalDetokenizer(tokenizer)
    start = time.perf_counter()
    num_tokens = 0
    for token_id in generate_token_ids(runner, prompt_ids, params, tokenizer.eos_token_ids):
        num_tokens += 1
        sys.stdout.write(detokenizer.push(token_id))
        sys.stdout.flush()
    generate_s = time.perf_counter() - start
    sys.stdout.write("\n")
    print(
        f"[{args.model} on {device} {str(dtype).removeprefix('torch.')}: model loaded in {model_load_s:.2f} s, "
        f"tokenizer in {tokenizer_load_s:.2f} s, "
        f"{len(prompt_ids)} prompt + {num_tokens} generated tokens in {generate_s:.2f} s "
        f"({num_tokens / generate_s:.1f} tokens/s)]",
        file=sys.stderr,
    )
    return 0
