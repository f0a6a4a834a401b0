"""The batched sampler: greedy, temperature, top-k, top-p, per-request seeds, banned tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.outputs import TokenLogprobs
from engine.core.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private random stream for a seeded request; None means the global one."""
    if params.seed is None or params.is_greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned_token_ids: Sequence[frozenset[int]] | None = None,
) -> list[int]:
    """One token id per row of ``logits`` [B, vocab]; a row's banned ids are never drawn."""
    if banned_token_ids is not None and any(banned_token_ids):
        logits = logits.clone()
        for row, banned in enumerate(banned_token_ids):
            if banned:
                logits[row, list(banned)] = float("-inf")
    greedy = logits.argmax(dim=-1).tolist()
    return [greedy[i] if p.is_greedy else _sample_row(logits[i], p, generators[i]) for i, p in enumerate(params)]


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def compute_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of ``logits`` [B, vocab]: the log-softmax value of ``token_ids[row]`` and the ``num_top[row]`` best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    top = torch.topk(logprobs, max(num_top), dim=-1) if max(num_top) > 0 else None
    results = []
    for row, (token_id, k) in enumerate(zip(token_ids, num_top, strict=True)):
        top_ids = tuple(top.indices[row, :k].tolist()) if top is not None else ()
        top_values = tuple(top.values[row, :k].tolist()) if top is not None else ()
        results.append(TokenLogprobs(token_id, chosen[row], top_ids, top_values))
    return results
