from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.sampling import compute_logprobs, make_generator, sample


def random_logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 3


def test_greedy_is_argmax():
    logits = random_logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [None] * 4) == logits.argmax(dim=-1).tolist()


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    logits = random_logits()
    for params in (
        SamplingParams(temperature=1.5, top_k=1, seed=3),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=3),
    ):
        generators = [make_generator(params, torch.device("cpu")) for _ in range(4)]
        assert sample(logits, [params] * 4, generators) == logits.argmax(dim=-1).tolist()


def test_top_k_only_draws_from_the_k_most_likely():
    logits = random_logits(rows=1)
    params = SamplingParams(temperature=5.0, top_k=3, seed=0)
    generator = make_generator(params, torch.device("cpu"))
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    drawn = {sample(logits, [params], [generator])[0] for _ in range(200)}
    assert drawn <= allowed
    assert len(drawn) == 3


def test_draws_follow_the_softmax_and_never_pick_a_banned_token():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    params = SamplingParams(temperature=1.0, seed=5)
    generator = make_generator(params, torch.device("cpu"))
    draws = 20_000
    counts = torch.zeros(5)
    for _ in range(draws):
        counts[sample(logits, [params], [generator], [frozenset({4})])[0]] += 1
    expected = torch.softmax(logits[0, :4], dim=-1) * draws
    assert counts[4] == 0
    # Within 4 standard deviations of the binomial count, for each token.
    assert torch.all((counts[:4] - expected).abs() <= 4 * (expected * (1 - expected / draws)).sqrt())


def test_seed_makes_a_row_independent_of_its_batch_neighbours():
    logits = random_logits()
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits[:1], [seeded], [make_generator(seeded, torch.device("cpu"))])[0] for _ in range(3)]
    other = SamplingParams(temperature=1.0)
    in_batch = sample(
        logits[:2],
        [seeded, other],
        [make_generator(seeded, torch.device("cpu")), make_generator(other, torch.device("cpu"))],
    )[0]
    assert alone == [alone[0]] * 3
    assert in_batch == alone[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_invalid_parameters_are_rejected_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logprobs_of_chosen_and_top_tokens_come_from_log_softmax():
    logits = random_logits(rows=3)
    values = compute_logprobs(logits, [5, 0, 49], [2, 0, 4])
    expected = torch.log_softmax(logits, dim=-1)
    assert [v.logprob for v in values] == pytest.approx(
        [float(expected[0, 5]), float(expected[1, 0]), float(expected[2, 49])]
    )
    assert [len(v.top_token_ids) for v in values] == [2, 0, 4]
    assert list(values[2].top_token_ids) == expected[2].topk(4).indices.tolist()
    assert values[2].top_logprobs == pytest.approx(expected[2].topk(4).values.tolist())


@pytest.mark.parametrize("logprobs", [-1, 21, 1.5])
def test_logprobs_out_of_range_is_rejected(logprobs):
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=logprobs)


def test_penalties_follow_openai_and_vllm_arithmetic():
    logits = torch.tensor([[4.0, 3.0, -1.0, 2.5, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    # Output so far: token 0 twice. Frequency 0.8 takes 1.6 off token 0 (4.0 -> 2.4 < 3.0): token 1 wins.
    assert sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.8)], [None], None, [((), [0, 0])]) == [1]
    # Presence 0.8 takes 0.8 once (4.0 -> 3.2 > 3.0): token 0 still wins; 1.2 makes it 2.8.
    assert sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.8)], [None], None, [((), [0, 0])]) == [0]
    assert sample(logits, [SamplingParams(temperature=0.0, presence_penalty=1.2)], [None], None, [((), [0, 0])]) == [1]
    # Repetition 2 over prompt token 0 and output token 1: 4.0 -> 2.0, 3.0 -> 1.5; token 3 (2.5) wins.
    repetition = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [repetition], [None], None, [([0], [1])]) == [3]
    # A negative logit is multiplied, so it goes down too: token 0 (-0.5 -> -1.0) falls below token 1 (-0.8).
    assert sample(torch.tensor([[-0.5, -0.8, -3.0]]), [repetition], [None], None, [([0], [])]) == [1]
    assert sample(logits, [greedy], [None]) == [0]


def test_logit_bias_and_min_p():
    logits = torch.tensor([[4.0, 3.0, -1.0, 2.5, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias=((2, 100.0),))], [None]) == [2]
    assert sample(logits, [SamplingParams(temperature=0.0, logit_bias=((0, -100.0),))], [None]) == [1]
    # min_p at temperature 1: only tokens at least min_p times as likely as token 0 remain (token 1: e^-1 = 0.37).
    assert tokens_drawn(logits, min_p=0.5) == {0}
    assert tokens_drawn(logits, min_p=0.3) == {0, 1}


def tokens_drawn(logits: torch.Tensor, min_p: float, draws: int = 30) -> set[int]:
    drawn = set()
    for seed in range(draws):
        params = SamplingParams(temperature=1.0, min_p=min_p, seed=seed)
        drawn.add(sample(logits, [params], [make_generator(params, torch.device("cpu"))])[0])
    return drawn
