"""When a request is done, and how much of its text may be shown yet. No torch here.

The engine asks ``check_stop`` once after each new token, the one place a request ends by itself: a stop token
(EOS unless ``ignore_eos``, or one of ``stop_token_ids``; either only once ``min_tokens`` are out), then a stop
string in the decoded text, then ``max_tokens``. Aborts and errors are commands, not checks.

A stop string may arrive split over several tokens. Until it completes or cannot, the tail of the text that could be
its beginning is held back (``releasable_text_end``), so no consumer ever sees a stop string or has to take text
back::

    stop = "\\n\\nQ:"     text so far = "... the answer.\\n\\n"
                                       released -----^ held back: "\\n\\n"
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.outputs import FinishReason
from engine.core.request import Request


@dataclass(frozen=True)
class Stop:
    finish_reason: FinishReason
    # The stop token id or stop string that ended the request; None for length.
    reason: int | str | None = None
    # Where the request's visible text ends: before a matched stop string, else all of it.
    text_end: int | None = None


def check_stop(request: Request, num_new_chars: int) -> Stop | None:
    """After the request's newest token was appended, and ``num_new_chars`` characters of its text to
    ``request.output_text``: how it ends now, or None if it goes on."""
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    is_stop_token = token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids)
    # The token was sampled after num_output_tokens - 1 others: allowed once that count reached min_tokens.
    if is_stop_token and request.num_output_tokens > params.min_tokens:
        return Stop(FinishReason.STOP, token_id)
    if params.stop and num_new_chars:
        match = _first_stop_string(request.output_text, params.stop, num_new_chars)
        if match is not None:
            position, stop_string = match
            return Stop(FinishReason.STOP, stop_string, position)
    if request.num_output_tokens >= params.max_tokens:
        return Stop(FinishReason.LENGTH)
    return None


def releasable_text_end(text: str, stop_strings: tuple[str, ...], finished: bool) -> int:
    """How much of ``text`` may be shown: all of it once the request is finished, else all but the longest tail
    that is the beginning of a stop string."""
    if finished or not stop_strings:
        return len(text)
    return len(text) - max(_longest_partial_match(text, stop) for stop in stop_strings)


def _longest_partial_match(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` without completing it, in time linear in
    ``len(stop)`` (Knuth-Morris-Pratt over the last ``len(stop) - 1`` characters of the text): a request's stop
    strings cost the same at every token, whatever their length."""
    border = [0] * len(stop)  # border[i]: the longest proper prefix of stop[: i + 1] that also ends it
    for i in range(1, len(stop)):
        k = border[i - 1]
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        border[i] = k + (stop[i] == stop[k])
    matched = 0  # the tail is shorter than stop, so it never matches whole
    for char in text[len(text) - len(stop) + 1 :] if len(stop) <= len(text) else text:
        while matched and char != stop[matched]:
            matched = border[matched - 1]
        matched += char == stop[matched]
    return matched


def _first_stop_string(text: str, stop_strings: tuple[str, ...], num_new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends in its last ``num_new_chars`` characters (text before those
    was searched already), as (position, stop string)."""
    longest = max(map(len, stop_strings))
    search_from = max(0, len(text) - num_new_chars - longest + 1)
    found = [(position, s) for s in stop_strings if (position := text.find(s, search_from)) >= 0]
    return min(found) if found else None
