"""The ``kvstorm`` console script, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import requests

from kvstorm.engine_commands import ADMIN_TOKEN_ENV


def run_kvstorm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstorm", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_generate_streams_the_answer_to_a_chat_prompt():
    # float32: the answer's first token wins by 0.08 of a logit near 25 ("The" over "L"), under bfloat16's step
    # there, so in bfloat16 the two tie on some CPUs and the lower id ("L'Étoile...") wins.
    chat = ("generate", "--chat", "--dtype", "float32", "--prompt", "What is the capital of France?")
    result = run_kvstorm(*chat, "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr


def test_generate_with_a_seed_is_reproducible():
    args = ("generate", "--prompt", "Once upon a time", "--max-tokens", "8", "--temperature", "0.9", "--seed", "5")
    first, second = run_kvstorm(*args), run_kvstorm(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_invariant_rows_and_the_matmul_kernel_are_chosen_by_name_and_others_are_refused():
    # One generation with both (each run loads the model): which kernel an engine takes is tested in
    # tests/engine/test_engine_tiny.py.
    chosen = ("--invariant-rows", "latency", "--matmul-kernel", "onednn")
    result = run_kvstorm("generate", "--prompt", "Once upon a time", "--max-tokens", "4", *chosen)
    assert result.returncode == 0, result.stderr
    assert "4 generated tokens" in result.stderr
    assert "finish reason length]" in result.stderr
    for option, unknown in (("--invariant-rows", "fastest"), ("--matmul-kernel", "mkl")):
        result = run_kvstorm("generate", "--prompt", "x", option, unknown)
        assert result.returncode == 2
        assert f"invalid choice: '{unknown}'" in result.stderr


def test_bad_arguments_exit_2_with_a_message():
    result = run_kvstorm("generate", "--model", "nope", "--prompt", "x")
    assert result.returncode == 2
    assert "cannot resolve model 'nope'" in result.stderr
    result = run_kvstorm("generate", "--prompt", "x", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature must be >= 0" in result.stderr


def test_bench_offline_runs_any_model_and_backend_and_records_the_run(tmp_path):
    result_file = tmp_path / "offline.json"
    result = run_kvstorm(
        "bench", "--no-docs", "offline", "--model", "random:tiny", "--attention-backend", "torch", "--dtype", "float32",
        "--num-requests", "3", "--kv-cache-memory", "512KiB", "--static-batch-sizes", "", "--no-continuous",
        "--json", str(result_file),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result_file.read_text())
    (kvstorm,) = data["results"]
    assert kvstorm["output_tokens"] == data["output_tokens"]  # ignore_eos: every request ran to its length
    assert kvstorm["details"]["attention_backend"] == "torch"  # the backend it was asked for, by its flag name
    # float32 on this torch's CPU build, each row's result batch-invariant (by default)
    assert kvstorm["details"]["matmul"].startswith("onednn-packed, batch-invariant in calls of ")
    assert kvstorm["details"]["layer_ops"] == "cpu-kernels"  # whatever the attention backend
    assert set(data["matmul_gflops"]) == {"torch.mm", "onednn-packed"}
    assert (
        kvstorm["details"]["num_preemptions"] > 0
    )  # 1024 slots of KV cannot hold these 3 requests (1613 tokens at the end)
    assert "model random:tiny" in result.stdout
    # The recorded command reproduces the run without naming where this machine kept its raw results.
    assert "Reproduce: `kvstorm bench --no-docs offline --model random:tiny --attention-backend torch" in result.stdout
    assert str(result_file) not in result.stdout


def test_bench_offline_refuses_transformers_peers_for_another_model():
    result = run_kvstorm("bench", "--no-docs", "offline", "--model", "random:tiny", "--num-requests", "1")
    assert result.returncode == 2
    assert "the transformers peers run smollm2-135m only" in result.stderr


def test_serve_listens_on_loopback_answers_and_stops_cleanly_on_sigterm():
    command = [sys.executable, "-m", "kvstorm", "serve", "--model", "random:tiny", "--port", "0"]
    command += ["--kv-cache-memory", "8MiB", "--swap-space", "0", "--attention-backend", "torch"]
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, said = None, []
        for line in server.stderr:
            said.append(line)
            if "listening on " in line:
                url = line.strip().rsplit(" ", 1)[-1]
                break
        assert url is not None, "the server never said where it listens"
        # Admission is on by default, and the start says so and how to queue a batch instead.
        (admission,) = [line for line in said if line.startswith("kvstorm serve: admission")]
        assert "on: a request that would miss these is refused with 429 and Retry-After" in admission
        assert "(TTFT objective 10 s)" in admission
        assert "--ttft-slo off to queue it all" in admission
        assert url.startswith("http://127.0.0.1:"), "the default bind address is loopback"
        body = {"model": "random:tiny", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
        response = requests.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4
        assert requests.post(f"{url}/admin/pause", timeout=10).status_code == 404, "no admin routes without a token"
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
