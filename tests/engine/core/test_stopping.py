"""The one place a request ends by itself, and how much of its text may be shown before it ends."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.outputs import FinishReason
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.stopping import check_stop, releasable_text_end

EOS = 2


def request_after(tokens: list[int], text: str = "", **params: object) -> Request:
    """A request that has produced ``tokens`` (the last one just now) and whose output decodes to ``text``."""
    request = Request("r", [5, 6], SamplingParams(**params), eos_token_ids=frozenset({EOS}))
    request.output_token_ids = list(tokens)
    request.output_text = text
    return request


def test_eos_ends_a_request_once_min_tokens_are_out_unless_ignored():
    assert check_stop(request_after([9, EOS], max_tokens=8), 0).finish_reason is FinishReason.STOP
    assert check_stop(request_after([9, EOS], max_tokens=8), 0).reason == EOS
    assert check_stop(request_after([9, EOS], max_tokens=8, min_tokens=2), 0) is None
    assert check_stop(request_after([9, 9, EOS], max_tokens=8, min_tokens=2), 0) is not None
    assert check_stop(request_after([9, EOS], max_tokens=8, ignore_eos=True), 0) is None
    assert check_stop(request_after([9, 7], max_tokens=8, stop_token_ids=(7,)), 0).reason == 7


def test_length_ends_a_request_at_max_tokens():
    stop = check_stop(request_after([9, 9, 9], max_tokens=3), 0)
    assert (stop.finish_reason, stop.reason, stop.text_end) == (FinishReason.LENGTH, None, None)


def test_a_stop_string_is_found_where_it_completes_even_across_tokens_and_wins_over_length():
    # "\n\nQ" arrived as "\n", "\n", "Q:": the search covers the end of the text before the new characters.
    request = request_after([9, 9, 9], "The answer.\n\nQ:", max_tokens=3, stop=("\n\nQ",))
    stop = check_stop(request, num_new_chars=2)
    assert (stop.finish_reason, stop.reason, stop.text_end) == (FinishReason.STOP, "\n\nQ", len("The answer."))
    # The earliest of several stop strings ends the text.
    request = request_after([9], "a STOP b END", max_tokens=8, stop=("END", "STOP"))
    assert check_stop(request, num_new_chars=len("a STOP b END")).text_end == 2
    # Text searched before cannot hold a new match: no new characters, no stop string.
    assert check_stop(request_after([9], "STOP", max_tokens=8, stop=("STOP",)), num_new_chars=0) is None


def test_the_released_text_holds_back_only_what_could_begin_a_stop_string():
    stops = ("\n\nQ:", "###")
    assert releasable_text_end("The answer.\n\n", stops, finished=False) == len("The answer.")
    assert releasable_text_end("The answer.\n\nQ", stops, finished=False) == len("The answer.")
    assert releasable_text_end("a ##", stops, finished=False) == len("a ")
    assert releasable_text_end("a #b", stops, finished=False) == len("a #b")
    assert releasable_text_end("a ##", stops, finished=True) == len("a ##")
    assert releasable_text_end("a ##", (), finished=False) == len("a ##")


def held_back_by_definition(text: str, stops: tuple[str, ...]) -> int:
    """The longest end of ``text`` that begins a stop string without completing it, by trying every length."""
    return max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


@settings(max_examples=500)
@given(
    text=st.text(alphabet="ab\n#", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n#", min_size=1, max_size=8), min_size=1, max_size=4).map(tuple),
)
def test_the_text_held_back_is_the_longest_partial_stop_string(text, stops):
    assert releasable_text_end(text, stops, finished=False) == len(text) - held_back_by_definition(text, stops)
