"""Schedules, workloads and Locust shapes are pure functions: checked without sleeping or a server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.arrivals import _renewal, expected_num_arrivals, make_arrivals, scale_rates
from loadgen.sessions import build_sessions
from loadgen.shapes import make_shape
from loadgen.workloads import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MAX_SAMPLED_LENGTH,
    build_plan,
    mean_length,
    request_body,
    sample_lengths,
)


def offsets(text: str, **bounds) -> np.ndarray:
    return np.asarray([arrival.offset_s for arrival in make_arrivals(text, seed=1, **bounds)])


def test_constant_rate_is_evenly_spaced_and_bounded_by_count_or_duration():
    np.testing.assert_allclose(offsets("constant:rate=4", num_requests=5, duration_s=None), [0, 0.25, 0.5, 0.75, 1])
    assert len(offsets("constant:rate=4", num_requests=None, duration_s=10)) == 40


def test_poisson_and_gamma_have_the_rate_and_the_burstiness_asked_for():
    poisson = np.diff(offsets("poisson:rate=50", num_requests=20000, duration_s=None))
    assert poisson.mean() == pytest.approx(1 / 50, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(offsets("gamma:rate=50,burstiness=0.25", num_requests=20000, duration_s=None))
    assert bursty.mean() == pytest.approx(1 / 50, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # gamma shape k: CV 1/sqrt(k)


def test_onoff_bursts_at_the_start_of_every_period():
    arrivals = offsets("onoff:base=2,burst=20,burst_s=1,period_s=4,spacing=even", num_requests=None, duration_s=8)
    in_burst = (arrivals % 4) < 1
    assert in_burst.sum() == 2 * 20  # two periods, 20/s for 1 s each
    assert (~in_burst).sum() == 2 * 6  # 2/s for the other 3 s of each period
    poisson = offsets("onoff:base=2,burst=20,burst_s=1,period_s=4", num_requests=None, duration_s=400)
    assert ((poisson % 4) < 1).sum() / 100 == pytest.approx(20, rel=0.1)


def test_steps_ramp_and_the_last_rate_holds():
    arrivals = offsets("steps:rates=2/4/8,step_s=1,spacing=even", num_requests=None, duration_s=5)
    counts = np.histogram(arrivals, bins=[0, 1, 2, 3, 4, 5])[0]
    assert counts.tolist() == [2, 4, 8, 8, 8]


def test_trace_replay_keeps_times_and_lengths(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100.5, "prompt_len": 7, "output_len": 3},
        {"timestamp": 100.0, "prompt_len": 5, "output_len": 9},
    ]
    trace.write_text("\n".join(json.dumps(row) for row in rows))
    arrivals = make_arrivals(f"trace:path={trace},speedup=2", num_requests=None, duration_s=None)
    assert [(a.offset_s, a.prompt_len, a.output_len) for a in arrivals] == [(0.0, 5, 9), (0.25, 7, 3)]
    plan = build_plan(arrivals, "random", input_len="fixed:100", output_len="fixed:100")
    assert [(len(p.body["prompt"]), p.max_tokens) for p in plan] == [(5, 9), (7, 3)]
    csv_trace = tmp_path / "trace.csv"
    csv_trace.write_text("timestamp,prompt_len,output_len\n3.0,4,2\n1.0,6,8\n")
    arrivals = make_arrivals(f"trace:path={csv_trace}", num_requests=None, duration_s=None)
    assert [(a.offset_s, a.prompt_len, a.output_len) for a in arrivals] == [(0.0, 6, 8), (2.0, 4, 2)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("poisson:rate=0", "must be >="),
        ("poisson:rate=5,burstiness=2", "unknown key"),
        ("zipf:rate=5", "unknown kind"),
        ("onoff:base=1,burst=5,burst_s=9,period_s=4", "longer than period_s"),
        ("poisson:rate=5", "--num-requests or --duration"),
    ],
)
def test_bad_arrival_specs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        make_arrivals(text, num_requests=None, duration_s=None)


@pytest.mark.parametrize(
    ("text", "factor", "scaled"),
    [
        ("constant:rate=2", 0.5, "constant:rate=1"),
        ("poisson:rate=3", 2, "poisson:rate=6"),
        ("gamma:rate=1,burstiness=0.5", 3, "gamma:rate=3,burstiness=0.5"),
        ("onoff:base=0.5,burst=2,burst_s=20,period_s=60", 0.8, "onoff:base=0.4,burst=1.6,burst_s=20,period_s=60"),
        ("steps:rates=1/2/4,step_s=10,spacing=even", 1.5, "steps:rates=1.5/3/6,step_s=10,spacing=even"),
    ],
)
def test_scaling_an_arrival_multiplies_its_rates_and_keeps_its_durations(text, factor, scaled):
    assert scale_rates(text, factor) == scaled
    full = offsets(scale_rates(text, 1), num_requests=None, duration_s=600)
    half = offsets(scale_rates(text, 0.5), num_requests=None, duration_s=600)
    assert len(half) == pytest.approx(len(full) / 2, rel=0.3)


@pytest.mark.parametrize(
    ("text", "factor", "message"),
    [
        ("trace:path=t.jsonl", 2, "cannot be scaled"),
        ("poisson:rate=1", 0, "must be > 0"),
        ("steps:rates=1/30/2,step_s=5", 1, "rates 30 exceeds 20"),
        ("onoff:base=1,burst=25,period_s=10,burst_s=2", 1, "burst 25 exceeds 20"),
    ],
)
def test_an_arrival_that_cannot_be_scaled_says_why(text, factor, message):
    with pytest.raises(ValueError, match=message):
        scale_rates(text, factor, max_rate=20)


@pytest.mark.parametrize(
    ("text", "bounds"),
    [
        ("constant:rate=3", {"duration_s": 100}),
        ("poisson:rate=50", {"duration_s": 60}),
        ("gamma:rate=20,burstiness=0.5", {"duration_s": 100}),
        ("onoff:base=2,burst=40,burst_s=5,period_s=30", {"duration_s": 300}),
        ("onoff:base=2,burst=40,burst_s=5,period_s=30,spacing=even", {"duration_s": 300}),
        ("steps:rates=5/10/20,step_s=30", {"duration_s": 120}),
        ("poisson:rate=50", {"duration_s": 60, "num_requests": 700}),
        ("poisson:rate=50", {"duration_s": None, "num_requests": 700}),
    ],
)
def test_the_expected_count_of_an_arrival_is_what_it_schedules(text, bounds):
    bounds = {"num_requests": None, **bounds}
    assert expected_num_arrivals(text, **bounds) == pytest.approx(len(offsets(text, **bounds)), rel=0.05)


def test_the_expected_count_of_a_tiny_period_over_an_hour_is_worked_out_not_walked():
    # 1.8 million periods: a loop over them would take seconds; whole periods are counted at once.
    text = "onoff:base=1,burst=3,burst_s=0.001,period_s=0.002"
    assert expected_num_arrivals(text, num_requests=None, duration_s=3600) == pytest.approx(3600 * 2)
    with pytest.raises(ValueError, match="--num-requests or --duration"):
        expected_num_arrivals("poisson:rate=1", num_requests=None, duration_s=None)


def test_the_mean_of_each_length_distribution_matches_its_samples():
    rng = np.random.default_rng(0)
    for text in (
        "fixed:128",
        "uniform:64-192",
        "normal:mean=256,std=32",
        "lognormal:median=100,sigma=0.5",
        # Clipped: a good share of the samples are at 1 or at the max, and the mean says so.
        "normal:mean=20000,std=20000",
        "lognormal:median=1000,sigma=3",
        "lognormal:median=200,sigma=1.5,max=512",
    ):
        assert mean_length(text) == pytest.approx(sample_lengths(text, 200_000, rng).mean(), rel=0.02)


def test_normal_and_lognormal_lengths_are_clipped_to_their_documented_bounds():
    rng = np.random.default_rng(0)
    # What the issue measured unclipped: 172,600 and 3.7 M tokens.
    normal = sample_lengths("normal:mean=20000,std=40000", 100_000, rng)
    assert (normal.min(), normal.max()) == (1, MAX_SAMPLED_LENGTH) == (1, 32_768)
    lognormal = sample_lengths("lognormal:median=32768,sigma=1", 100_000, rng)
    assert lognormal.min() >= 1
    assert lognormal.max() == MAX_SAMPLED_LENGTH
    assert sample_lengths("lognormal:median=1000,sigma=2,max=4096", 10_000, rng).max() == 4096
    assert sample_lengths("lognormal:median=60000,sigma=0.1,max=131072", 1_000, rng).min() > 32_768
    with pytest.raises(ValueError, match="median=40000 is above max=32768"):
        sample_lengths("lognormal:median=40000,sigma=1", 1, rng)
    with pytest.raises(ValueError, match="unknown key"):
        sample_lengths("normal:mean=10,std=1,min=5", 1, rng)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert set(sample_lengths("fixed:16", 10, rng)) == {16}
    uniform = sample_lengths("uniform:3-5", 1000, rng)
    assert set(uniform) == {3, 4, 5}
    assert sample_lengths("normal:mean=200,std=20", 5000, rng).mean() == pytest.approx(200, rel=0.02)
    assert np.median(sample_lengths("lognormal:median=100,sigma=0.5", 5000, rng)) == pytest.approx(100, rel=0.05)
    assert sample_lengths("normal:mean=1,std=50", 1000, rng).min() >= 1
    with pytest.raises(ValueError, match="uniform:LOW-HIGH"):
        sample_lengths("uniform:5", 1, rng)


def test_random_workload_sends_token_ids_in_the_safe_range():
    arrivals = make_arrivals("constant:rate=1", num_requests=20, duration_s=None)
    plan = build_plan(arrivals, "random:low=100,high=200", input_len="uniform:5-50", output_len="fixed:8")
    for planned in plan:
        assert planned.path == COMPLETIONS_PATH
        assert 5 <= len(planned.body["prompt"]) <= 50
        assert all(100 <= token_id < 200 for token_id in planned.body["prompt"])
    assert len({tuple(p.body["prompt"]) for p in plan}) == 20


def test_chat_workload_builds_prompts_of_about_the_length_from_the_shipped_corpus():
    arrivals = make_arrivals("constant:rate=1", num_requests=10, duration_s=None)
    plan = build_plan(arrivals, "chat", input_len="fixed:400", output_len="fixed:8")
    for planned in plan:
        assert planned.path == CHAT_PATH
        (message,) = planned.body["messages"]
        assert message["role"] == "user"
        assert len(message["content"].split()) == 300  # 0.75 words per token
    assert len({p.body["messages"][0]["content"] for p in plan}) > 1


def test_shared_prefix_workload_repeats_its_prefixes_and_counts_what_an_earlier_request_sent():
    arrivals = make_arrivals("constant:rate=1", num_requests=30, duration_s=None)
    spec = "shared-prefix:num_prefixes=3,prefix_len=40,low=100,high=200"
    plan = build_plan(arrivals, spec, input_len="fixed:10", output_len="fixed:8")
    assert plan == build_plan(arrivals, spec, input_len="fixed:10", output_len="fixed:8")  # seeded
    prefixes = [tuple(p.body["prompt"][:40]) for p in plan]
    assert len(set(prefixes)) == 3
    for index, planned in enumerate(plan):
        first_of_its_prefix = prefixes.index(prefixes[index]) == index
        assert planned.shared_prefix_tokens == (0 if first_of_its_prefix else 40)
        assert len(planned.body["prompt"]) == 50
    with pytest.raises(ValueError, match="missing num_prefixes"):
        build_plan(arrivals, "shared-prefix:prefix_len=40", input_len="fixed:10", output_len="fixed:8")


def test_multiturn_sessions_are_planned_per_arrival_and_refuse_the_single_request_planner():
    arrivals = make_arrivals("constant:rate=1", num_requests=4, duration_s=None)
    plan = build_sessions(
        arrivals, "multiturn:turns=3,system_len=20,think_s=2s", input_len="fixed:8", output_len="fixed:5"
    )
    assert (plan.num_turns, plan.think_s, plan.num_requests) == (3, 2.0, 12)
    assert len(plan.system_prompt.split()) == 15
    assert [len(s.user_messages) for s in plan.sessions] == [3] * 4
    assert {s.max_tokens for s in plan.sessions} == {(5, 5, 5)}
    assert [s.offset_s for s in plan.sessions] == [a.offset_s for a in arrivals]
    with pytest.raises(ValueError, match=r"turns=0\.0 must be >= 1"):
        build_sessions(arrivals, "multiturn:turns=0", input_len="fixed:8", output_len="fixed:5")
    with pytest.raises(ValueError, match="session workload"):
        build_plan(arrivals, "multiturn:turns=2", input_len="fixed:8", output_len="fixed:5")


def test_planners_of_one_run_share_the_prefixes_and_system_prompt_of_their_shared_seed():
    arrivals = make_arrivals("constant:rate=1", num_requests=8, duration_s=None)
    lengths = {"input_len": "fixed:10", "output_len": "fixed:8"}
    spec = "shared-prefix:num_prefixes=2,prefix_len=40"
    one, other = (build_plan(arrivals, spec, **lengths, seed=seed, shared_seed=7) for seed in (1, 2))
    assert {tuple(p.body["prompt"][:40]) for p in one} == {tuple(p.body["prompt"][:40]) for p in other}
    assert len({tuple(p.body["prompt"][:40]) for p in one}) == 2
    assert [p.body["prompt"][40:] for p in one] != [p.body["prompt"][40:] for p in other]
    workload = "multiturn:turns=2,system_len=20"
    one, other = (build_sessions(arrivals, workload, **lengths, seed=seed, shared_seed=7) for seed in (1, 2))
    assert one.system_prompt == other.system_prompt
    assert one.sessions[0].user_messages != other.sessions[0].user_messages


def test_jsonl_workload(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}\n')
    arrivals = make_arrivals("constant:rate=1", num_requests=3, duration_s=None)
    plan = build_plan(arrivals, f"jsonl:path={prompts}", input_len="fixed:1", output_len="fixed:7")
    assert [(p.path, p.max_tokens) for p in plan] == [(COMPLETIONS_PATH, 7), (CHAT_PATH, 3), (COMPLETIONS_PATH, 7)]


def test_request_body_asks_for_exact_output_lengths_and_usage():
    (planned,) = build_plan(make_arrivals("constant:rate=1", num_requests=1, duration_s=None), "random",
                            input_len="fixed:2", output_len="fixed:9")  # fmt: skip
    body = request_body(planned, "m", exact_output=True, extra_body={"temperature": 0})
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"], body["temperature"]) == (9, 9, True, 0)
    assert "ignore_eos" not in request_body(planned, "m", exact_output=False)


def test_corpus_ships_as_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "corpus.txt" in config["tool"]["setuptools"]["package-data"]["loadgen"]


def test_shapes_over_time():
    onoff = make_shape("onoff:base=2,burst=20,burst_s=10,period_s=60", default_users=1, spawn_rate=5, run_time_s=130)
    assert [onoff.tick(t) for t in (0, 9.9, 10, 59, 60, 75)] == [(20, 5), (20, 5), (2, 5), (2, 5), (20, 5), (2, 5)]
    assert onoff.tick(130) is None
    spike = make_shape("spike:base=1,peak=50,at_s=30,spike_s=5,spawn_rate=100", default_users=1, spawn_rate=None,
                       run_time_s=None)  # fmt: skip
    assert [spike.tick(t)[0] for t in (0, 29, 30, 34.9, 35)] == [1, 1, 50, 50, 1]
    assert spike.tick(1e6) == (1, 100)
    step = make_shape("step:start=5,step=5,step_s=30,max=12", default_users=1, spawn_rate=None, run_time_s=None)
    assert [step.tick(t) for t in (0, 30, 60, 999)] == [(5, 5.0), (10, 10.0), (12, 12.0), (12, 12.0)]
    assert make_shape("constant", default_users=7, spawn_rate=None, run_time_s=None).tick(3) == (7, 7.0)
    with pytest.raises(ValueError, match="missing max"):
        make_shape("step:start=5,step=5,step_s=30", default_users=1, spawn_rate=None, run_time_s=None)


def test_gaps_are_drawn_until_the_bound_however_bursty():
    # Batches of three 1 s gaps: a duration of 10 s needs four batches, a count of 5 needs two.
    np.testing.assert_array_equal(_renewal(lambda: np.ones(3), None, 10.0), np.arange(13.0))
    np.testing.assert_array_equal(_renewal(lambda: np.ones(3), 5, None), np.arange(7.0))
    bursty = make_arrivals("gamma:rate=10,burstiness=0.02", num_requests=None, duration_s=60, seed=0)
    assert bursty[-1].offset_s > 30  # not cut off after a fixed number of draws
