"""Multi-turn chat sessions: ``--workload multiturn:turns=6,system_len=1000[,think_s=0]``.

Open loop across sessions, closed loop inside one. Each arrival of the arrival process starts a session at its
scheduled time, whatever the others are doing. Inside a session, turn k+1 leaves ``think_s`` after turn k's answer
ended, and sends the whole conversation so far: the system prompt (of about ``system_len`` tokens, the same for
every session), each earlier user message with the answer as it streamed, and a new user message of
``--input-len`` tokens; each answer asks for ``--output-len`` tokens. A turn that does not end ok ends its session:
its later turns are never sent, and the results count the session as cut short. A turn's ``scheduled_s`` is when
it was meant to leave (the arrival, or the answer's end plus the think time), and its latencies count from when it
left (``sent_s``), as for every request. :class:`Conversation` keeps one session's messages; the Locust front's
``ConversationUser`` runs its turns with it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.arrivals import Arrival
from loadgen.client import StreamingClient
from loadgen.records import Outcome, RequestRecord
from loadgen.runner import RunContext, RunStart, RunTiming, run_at_offsets, sleep_until
from loadgen.spec import parse_spec
from loadgen.workloads import CHAT_PATH, PlannedRequest, corpus_sentences, corpus_text, sample_lengths


@dataclass(frozen=True)
class PlannedSession:
    index: int
    offset_s: float
    user_messages: tuple[str, ...]
    max_tokens: tuple[int, ...]


@dataclass(frozen=True)
class SessionPlan:
    system_prompt: str
    think_s: float
    num_turns: int
    sessions: list[PlannedSession]

    @property
    def num_requests(self) -> int:
        """Requests the plan sends if no session is cut short."""
        return len(self.sessions) * self.num_turns


def build_sessions(
    arrivals: list[Arrival],
    workload: str,
    *,
    input_len: str,
    output_len: str,
    seed: int = 0,
    shared_seed: int | None = None,
) -> SessionPlan:
    """Every session's user messages and answer lengths, decided before the run (the answers are the server's).

    ``shared_seed`` draws the system prompt on its own (by default it is drawn with the rest from ``seed``): planners
    of parts of one run (Locust's users) pass the same one, so that every session of the run shares it."""
    spec = parse_spec(workload, {"multiturn"})
    spec.check_keys({"turns", "system_len", "think_s"})
    num_turns = spec.get_int("turns", minimum=1)
    system_len = spec.get_int("system_len", 0, minimum=0)
    think_s = spec.get_float("think_s", 0.0, minimum=0)
    rng = np.random.default_rng(seed + 1)
    shared_rng = rng if shared_seed is None else np.random.default_rng(shared_seed + 1)
    sentences = corpus_sentences()
    system_prompt = corpus_text(sentences, system_len, shared_rng) if system_len else ""
    user_lens = sample_lengths(input_len, len(arrivals) * num_turns, rng).reshape(-1, num_turns)
    output_lens = sample_lengths(output_len, len(arrivals) * num_turns, rng).reshape(-1, num_turns)
    sessions = [
        PlannedSession(
            index,
            arrival.offset_s,
            tuple(corpus_text(sentences, int(length), rng) for length in user_lens[index]),
            tuple(int(length) for length in output_lens[index]),
        )
        for index, arrival in enumerate(arrivals)
    ]
    return SessionPlan(system_prompt, think_s, num_turns, sessions)


async def run_sessions(
    plan: SessionPlan,
    client: StreamingClient,
    *,
    max_concurrency: int | None = None,
    start: RunStart | None = None,
) -> tuple[list[RequestRecord], RunTiming]:
    """Every session from its arrival, each turn after the previous answer; the records of the turns sent."""

    async def session(index: int, context: RunContext) -> None:
        await _run_session(plan, plan.sessions[index], context)

    offsets = [s.offset_s for s in plan.sessions]
    return await run_at_offsets(offsets, session, client, plan.num_requests, max_concurrency, start)


class Conversation:
    """One planned session's messages so far, the system prompt first: each turn adds its user message and sends the
    whole conversation; an answer that ended ok is added as it streamed, and every later turn sends it back."""

    def __init__(self, plan: SessionPlan, planned: PlannedSession) -> None:
        self.plan, self.planned = plan, planned
        self.messages = [{"role": "system", "content": plan.system_prompt}] if plan.system_prompt else []
        self.last_answer: RequestRecord | None = None

    def request(self, turn: int, scheduled_s: float) -> PlannedRequest:
        """Turn ``turn`` (from 0): its user message joins the conversation, and the request sends it all."""
        self.messages.append({"role": "user", "content": self.planned.user_messages[turn]})
        previous = self.last_answer
        return PlannedRequest(
            index=self.planned.index * self.plan.num_turns + turn,
            offset_s=scheduled_s,
            path=CHAT_PATH,
            body={"messages": list(self.messages)},
            max_tokens=self.planned.max_tokens[turn],
            # The previous turn's prompt and answer come first in this one (the system prompt, which other sessions
            # share too, is not counted).
            shared_prefix_tokens=(previous.prompt_tokens or 0) + previous.output_tokens if previous else 0,
        )

    def add_answer(self, record: RequestRecord, text: str) -> None:
        """The answer of the turn just sent, which ended ok (a turn that did not ends the session)."""
        self.last_answer = record
        self.messages.append({"role": "assistant", "content": text})


async def _run_session(plan: SessionPlan, planned: PlannedSession, context: RunContext) -> None:
    conversation = Conversation(plan, planned)
    scheduled_s = planned.offset_s
    for turn in range(plan.num_turns):
        await sleep_until(context.start_ts + scheduled_s)
        request = conversation.request(turn, scheduled_s)
        record, answer = await context.send(request, keep_text=True, session=planned.index, turn=turn + 1)
        if record.outcome is not Outcome.OK:
            break
        conversation.add_answer(record, answer)
        scheduled_s = record.end_s + plan.think_s
