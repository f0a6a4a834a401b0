"""The ``kvstorm`` console script, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def run_kvstorm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstorm", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_generate_streams_the_answer_to_a_chat_prompt():
    result = run_kvstorm("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr


def test_generate_with_a_seed_is_reproducible():
    args = ("generate", "--prompt", "Once upon a time", "--max-tokens", "8", "--temperature", "0.9", "--seed", "5")
    first, second = run_kvstorm(*args), run_kvstorm(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_bad_arguments_exit_2_with_a_message():
    result = run_kvstorm("generate", "--model", "nope", "--prompt", "x")
    assert result.returncode == 2
    assert "cannot resolve model 'nope'" in result.stderr
    result = run_kvstorm("generate", "--prompt", "x", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature must be >= 0" in result.stderr
