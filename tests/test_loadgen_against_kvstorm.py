"""The load generator against the real kvstorm server: every stream arrives whole and the numbers agree.

``loadgen`` knows nothing of the engine; this is the one place where the two meet, as a user would run them:
``kvstorm serve``'s app on a loopback port with the real model, ``kvstorm bench serve`` in its own process.
"""

from __future__ import annotations

import requests

from loadgen.records import Outcome
from loadgen.results import RunResult
from tests.engine.serving.conftest import make_engine, metric_value, running_server
from tests.loadgen.conftest import run_bench_serve

OUTPUT_TOKENS = 6


def test_bench_serve_streams_exact_outputs_from_kvstorm(real_model, real_tokenizer, tmp_path):
    with running_server(make_engine(real_model, real_tokenizer, max_num_seqs=8)) as server:
        for workload, input_len in (("random:low=1000,high=30000", "uniform:8-64"), ("chat", "uniform:16-48")):
            results_dir = tmp_path / workload.split(":")[0]
            json_path = run_bench_serve(
                server.url,
                results_dir,
                "--model", "smollm2-135m", "--workload", workload, "--input-len", input_len,
                "--output-len", f"fixed:{OUTPUT_TOKENS}", "--arrival", "poisson:rate=20", "--num-requests", "10",
                "--request-timeout", "60s", "--stall-timeout", "30s",
            )  # fmt: skip
            result = RunResult.read(json_path)
            assert [r.outcome for r in result.records] == [Outcome.OK] * 10, [r.error for r in result.records]
            # ignore_eos + min_tokens made every output exactly as long as asked; the client counted every token.
            assert {r.output_tokens for r in result.records} == {OUTPUT_TOKENS}
            assert all(r.finish_reason == "length" for r in result.records)
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        assert metric_value(metrics, "vllm:request_success_total", finished_reason="length") == 20
        assert metric_value(metrics, "vllm:generation_tokens_total") == 20 * OUTPUT_TOKENS
