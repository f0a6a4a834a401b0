"""Locust front of the load generator: users that stream SSE from an OpenAI-compatible server.

    locust -f loadgen/locustfile.py --host http://127.0.0.1:8000 --model NAME            # web UI on :8089
    locust -f loadgen/locustfile.py --headless -u 20 -t 60s --host ... --model NAME --csv out
    locust -f loadgen/locustfile.py --master ...   +   locust -f loadgen/locustfile.py --worker   # distributed

User classes: ``StreamingUser`` sends single requests of ``--workload`` (chat when that is multiturn),
``ConversationUser`` holds multi-turn conversations (``--workload multiturn:...``, else ``--conversation``) and
``SharedPrefixUser`` sends shared-prefix requests (``--workload shared-prefix:...``, else ``--shared-prefix``) whose
prefixes every user of the run shares, each with suffixes of its own. Without a class named on the command line
(``locust ... ConversationUser``) the run uses the one class that the kind of ``--workload`` calls for (multiturn:
ConversationUser, shared-prefix: SharedPrefixUser, else StreamingUser); with ``--class-picker`` the web UI ticks
the classes of each run (none ticked: all three, a third of the users each). Workers keep every class: the master
names the class of each user it hands them. ``OpenLoopUser`` (picked when ``--arrival`` is given) sends kvstorm's
seeded open-loop plan instead, sharded over the workers, and the master merges their records into kvstorm's results
file and report.

Each request is reported four ways: the POST itself (Locust's own row: time to the response headers; failed when
the request was rejected or its stream broke), and our request types ``TTFT``, ``ITL`` (one sample per gap between
tokens) and ``E2E``, which show in the web UI and the CSV like any request. ``E2E`` fails for a broken stream or a
client timeout, with the reason. A conversation's TTFT is named by its turn (``turn 1``, ``turn 2``, ...: one row
per turn), and each conversation ends with a ``SESSION`` sample named ``conversation`` (its duration; failed
"cut short at turn K" when a turn was refused or broke, which ends it: the next one starts). Users loop without
waiting (a conversation waits its think time between turns); the load is the number of users, which the shape
(``--shape``, ``$LOCUST_SHAPE``; see ``loadgen/shapes.py``) can burst, spike or step over time.

Streams are checked by the same tracker as ``kvstorm bench serve`` (SSE framing, finish reason, ``[DONE]``, usage
against tokens delivered). The read blocks, so a stall cannot be cut while it happens: a gap longer than
``--stall-timeout`` is reported when the stream ends, and a server that never answers hits ``--request-timeout``.
gevent lives only in this file's process: nothing else in ``loadgen`` imports locust. The web UI binds 127.0.0.1 by
default and asks for a login wherever it may be reached from another machine (``loadgen/web_login.py``); its
``/swarm`` changes the load's size and target, never a path (``loadgen/web_swarm.py``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import gevent
import requests
import urllib3
from locust import HttpUser, LoadTestShape, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner
from urllib3.exceptions import ReadTimeoutError

from loadgen import web_login, web_swarm
from loadgen.arrivals import Arrival
from loadgen.client import retry_after_note, retry_wait_s
from loadgen.merged_run import merged_result
from loadgen.plan import plan_run
from loadgen.records import Outcome, RequestRecord
from loadgen.report import write_report
from loadgen.results import MAX_RETRIES, RunConfig
from loadgen.served_model import NoServedModel, served_model
from loadgen.sessions import Conversation, build_sessions
from loadgen.shapes import make_shape
from loadgen.spec import parse_duration, parse_spec
from loadgen.tracker import StreamTracker
from loadgen.workloads import WORKLOAD_KINDS, PlannedRequest, build_plan, is_session_workload, request_body

# Requests (conversations) each user plans, then sends over and over.
PLANNED_PER_USER = 64
# The seed of what every user of a run shares (shared-prefix's prefixes, a conversation's system prompt): the same in
# every user and every worker process, while each user draws the rest from a seed of its own.
SHARED_SEED = 0


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    group = parser.add_argument_group("kvstorm")
    group.add_argument(
        "--model",
        env_var="LOCUST_MODEL",
        default=None,
        help="model name the server expects (default: the first the host lists in /v1/models)",
    )
    group.add_argument(
        "--workload",
        env_var="LOCUST_WORKLOAD",
        default="chat",
        help="random, chat, jsonl:path=, shared-prefix:, multiturn: (also picks the user class when none is named)",
    )
    group.add_argument(
        "--conversation",
        env_var="LOCUST_CONVERSATION",
        default="multiturn:turns=6,system_len=1000,think_s=1",
        help="ConversationUser's workload when --workload is not multiturn",
    )
    group.add_argument(
        "--shared-prefix",
        env_var="LOCUST_SHARED_PREFIX",
        default="shared-prefix:num_prefixes=4,prefix_len=512",
        help="SharedPrefixUser's workload when --workload is not shared-prefix",
    )
    group.add_argument("--input-len", env_var="LOCUST_INPUT_LEN", default="fixed:128", help="prompt tokens")
    group.add_argument("--output-len", env_var="LOCUST_OUTPUT_LEN", default="fixed:64", help="max_tokens")
    group.add_argument("--exact-output", env_var="LOCUST_EXACT_OUTPUT", choices=["true", "false"], default="true")
    group.add_argument("--shape", env_var="LOCUST_SHAPE", default="constant", help="constant, onoff:, spike:, step:")
    group.add_argument("--stall-timeout", env_var="LOCUST_STALL_TIMEOUT", default="30s")
    group.add_argument("--request-timeout", env_var="LOCUST_REQUEST_TIMEOUT", default="600s")
    group.add_argument(
        "--retries",
        env_var="LOCUST_RETRIES",
        type=int,
        default=0,
        help="send a request refused with 429 or 503 again after its Retry-After, up to this many times",
    )
    group.add_argument(
        "--arrival",
        env_var="LOCUST_ARRIVAL",
        default=None,
        help="OpenLoopUser: kvstorm's open-loop schedule (poisson:rate=20, ...), sharded over the workers; picks "
        "that class when none is named",
    )
    group.add_argument("--num-requests", env_var="LOCUST_NUM_REQUESTS", type=int, default=None)
    group.add_argument("--duration", env_var="LOCUST_DURATION", default=None, help="the schedule's length (60s)")
    group.add_argument("--seed", env_var="LOCUST_SEED", type=int, default=0, help="seeds the schedule and prompts")
    group.add_argument(
        "--results-dir",
        env_var="LOCUST_RESULTS_DIR",
        default="bench-results",
        help="OpenLoopUser: where the master writes kvstorm's results file and report, merged from every worker",
    )
    web_login.add_arguments(parser)  # the web UI on loopback unless the operator says otherwise


@events.init.add_listener
def guard_web_ui(environment, web_ui=None, **_kwargs) -> None:
    """The login wherever the UI binds beyond loopback (Locust's final options, whatever set them), and /swarm
    limited to the UI's own form."""
    if web_ui is not None:
        web_login.install(web_ui)
        web_swarm.install(web_ui)


@events.init.add_listener
def choose_user_class(environment, **_kwargs) -> None:
    """Without a class named on the command line, the run uses the class --workload's kind calls for (the web UI's
    class picker, where enabled, chooses again for each run). A worker keeps every class: the master names them."""
    options = environment.parsed_options
    if options is None or options.user_classes or options.worker:
        return
    kind = parse_spec(options.workload, WORKLOAD_KINDS).kind
    environment.user_classes = [
        OpenLoopUser
        if options.arrival
        else {"multiturn": ConversationUser, "shared-prefix": SharedPrefixUser}.get(kind, StreamingUser)
    ]


class BrokenStream(Exception):
    """The E2E sample of a stream that did not end cleanly (broken stream or client timeout)."""


# The most one read of a stream hands to the tracker.
READ_BYTES = 64 << 10


def _reads(response: requests.Response) -> Iterator[bytes]:
    """A streamed body's bytes as they arrive, at most ``READ_BYTES`` at a time: per HTTP chunk when it is chunked,
    else whatever the socket has. ``iter_content(chunk_size=None)`` reads a body that is not chunked (close-delimited,
    or with a Content-Length) to its very end before it yields anything: a flood would pile up in memory, and no
    token would be timed until the last."""
    raw = response.raw
    if raw.chunked and raw.supports_chunked_reads():
        yield from raw.read_chunked(READ_BYTES, decode_content=True)
        return
    while data := raw.read1(READ_BYTES, decode_content=True):
        yield data


class WholeRequestTimeout(Exception):
    """Raised into a user's greenlet when its request, retries included, outlasts the request timeout."""


class CutShort(Exception):
    """The SESSION sample of a conversation that a turn which did not end ok cut short."""


def model_of(environment) -> str:
    """--model, or the model the host serves (asked once per host: the web UI may change the host)."""
    return environment.parsed_options.model or _served_model(environment.host or "")


_served_model = functools.cache(served_model)


class BaseStreamUser(HttpUser):
    """What every user class shares: one streamed request sent, checked and reported (:meth:`stream_request`)."""

    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        try:
            self.model = model_of(self.environment)
        except NoServedModel as error:
            # In the web UI's failures, not only in a worker's log; the user stops: it has nothing right to send.
            self.environment.events.request.fire(
                request_type="GET", name="/v1/models", response_time=0, response_length=0, exception=error, context={}
            )
            raise StopUser() from None
        self.exact_output = options.exact_output == "true"
        self.stall_timeout_s = parse_duration(options.stall_timeout)
        self.request_timeout_s = parse_duration(options.request_timeout)
        self.retries = options.retries
        # The user's own draws (suffixes, user messages, lengths): users of a run must not all send the same.
        self.seed = uuid.uuid4().int % (1 << 31)

    def stream_request(
        self, planned: PlannedRequest, *, ttft_name: str, keep_text: bool = False, run_start_ts: float | None = None
    ) -> tuple[RequestRecord, str]:
        """Streams ``planned`` and reports it (TTFT under ``ttft_name``; ITL and E2E under the path, once the stream
        started); returns its record and, with ``keep_text``, the text as it streamed. ``run_start_ts``: the zero
        of an open-loop run, on perf_counter's clock (else its send is its zero, and its schedule is now)."""
        request_id = str(uuid.uuid4())  # a UUID: some servers refuse an X-Request-Id of any other shape
        body = request_body(planned, self.model, exact_output=self.exact_output)
        sent_ts = time.perf_counter()
        tracker = StreamTracker(
            index=planned.index,
            request_id=request_id,
            scheduled_s=planned.offset_s if run_start_ts is not None else 0.0,
            sent_ts=sent_ts,
            run_start_ts=sent_ts if run_start_ts is None else run_start_ts,
            requested_output_tokens=planned.max_tokens,
            stall_timeout_s=self.stall_timeout_s,
            collect_text=keep_text,
        )
        try:
            # The whole request, retries included: a read timeout alone would let a server that keeps sending (endless
            # trailers, which urllib3 reads to their end) hold this user for as long as it likes.
            with gevent.Timeout(self.request_timeout_s, WholeRequestTimeout):
                record = self._exchange(planned, body, request_id, tracker)
        except WholeRequestTimeout:
            message = f"no complete answer within the request timeout ({self.request_timeout_s:g} s)"
            record = tracker.finish(time.perf_counter(), Outcome.CLIENT_TIMEOUT, message)
            self._fire("POST", planned.path, record.e2e_s, failure=BrokenStream(f"client_timeout: {message}"))
        if record.http_status == 200:
            self._report(planned.path, ttft_name, record)
        return record, tracker.text

    def _exchange(self, planned: PlannedRequest, body: dict, request_id: str, tracker: StreamTracker) -> RequestRecord:
        """The request sent (again after a refusal, as ``--retries`` allows) and its answer read."""
        while True:
            with self.client.post(
                planned.path,
                json=body,
                headers={"X-Request-Id": request_id},
                stream=True,
                catch_response=True,
                timeout=self.request_timeout_s,
            ) as response:
                status = tracker.http_status = response.status_code
                if status == 200:
                    record = self._read(response, tracker)
                    if record.outcome is Outcome.OK:
                        response.success()
                    else:
                        response.failure(f"{record.outcome.value}: {record.error}")
                    return record
                time_left_s = tracker.sent_ts + self.request_timeout_s - time.perf_counter()
                retry_after = response.headers.get("Retry-After", "")
                note = retry_after_note(retry_after) if self.retries else None
                if note is not None and note not in tracker.notes:
                    tracker.notes.append(note)
                delay_s = retry_wait_s(self.retries, status, retry_after, tracker.attempts, time_left_s)
                # Every refusal is a failed POST in Locust's table, a retried one too: the server refused it.
                response.failure(f"rejected: HTTP {status}" + ("" if delay_s is None else " (sent again)"))
                if delay_s is None:
                    return tracker.finish(time.perf_counter(), Outcome.REJECTED, f"HTTP {status}")
            gevent.sleep(delay_s)
            tracker.attempts += 1

    def _read(self, response: requests.Response, tracker: StreamTracker) -> RequestRecord:
        try:
            for chunk in _reads(response):
                tracker.feed(chunk, time.perf_counter())
                if tracker.cut_reason is not None:  # the stream broke a bound: it is not read further
                    response.close()
                    return tracker.finish(time.perf_counter(), Outcome.BROKEN_STREAM, tracker.cut_reason)
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError) as error:
            # requests re-raises a read timeout as a ConnectionError wrapping urllib3's error.
            if isinstance(error, (requests.exceptions.Timeout, ReadTimeoutError)) or isinstance(
                error.args[0] if error.args else None, ReadTimeoutError
            ):
                message = f"no data for the request timeout ({self.request_timeout_s:g} s)"
                return tracker.finish(time.perf_counter(), Outcome.CLIENT_TIMEOUT, message)
            return tracker.finish(time.perf_counter(), Outcome.BROKEN_STREAM, f"{type(error).__name__}: {error}")
        return tracker.finish(time.perf_counter())

    def _report(self, name: str, ttft_name: str, record: RequestRecord) -> None:
        if record.ttft_s is not None:
            self._fire("TTFT", ttft_name, record.ttft_s)
        for gap_s in record.itl_s:
            self._fire("ITL", name, gap_s)
        failure = None if record.outcome is Outcome.OK else BrokenStream(f"{record.outcome.value}: {record.error}")
        self._fire("E2E", name, record.e2e_s, length=record.output_tokens, failure=failure)

    def _fire(
        self, request_type: str, name: str, duration_s: float, *, length: int = 0, failure: Exception | None = None
    ) -> None:
        self.environment.events.request.fire(
            request_type=request_type,
            name=name,
            response_time=duration_s * 1e3,
            response_length=length,
            exception=failure,
            context={},
        )


class StreamingUser(BaseStreamUser):
    """Single requests of ``--workload`` (chat when that is multiturn: conversations are ConversationUser's)."""

    def on_start(self) -> None:
        super().on_start()
        options = self.environment.parsed_options
        self.requests = itertools.cycle(
            build_plan(
                [Arrival(0.0)] * PLANNED_PER_USER,
                self.workload(options),
                input_len=options.input_len,
                output_len=options.output_len,
                seed=self.seed,
                shared_seed=SHARED_SEED,
            )
        )

    @staticmethod
    def workload(options: argparse.Namespace) -> str:
        return "chat" if is_session_workload(options.workload) else options.workload

    @task
    def stream(self) -> None:
        planned = next(self.requests)
        self.stream_request(planned, ttft_name=planned.path)


class SharedPrefixUser(StreamingUser):
    """Shared-prefix requests: ``--workload shared-prefix:...``, else ``--shared-prefix``. Every user of the run
    sends the same prefixes (``SHARED_SEED``), each with suffixes of its own."""

    @staticmethod
    def workload(options: argparse.Namespace) -> str:
        is_shared_prefix = parse_spec(options.workload, WORKLOAD_KINDS).kind == "shared-prefix"
        return options.workload if is_shared_prefix else options.shared_prefix


class ConversationUser(BaseStreamUser):
    """Conversations one after another (``--workload multiturn:...``, else ``--conversation``), each planned as
    ``kvstorm bench serve`` plans a session: every turn sends the conversation so far with the answers as they
    streamed, ``think_s`` after the previous answer ended. The system prompt is the same for every user of the run.
    A turn that does not end ok cuts its conversation short."""

    def on_start(self) -> None:
        super().on_start()
        options = self.environment.parsed_options
        workload = options.workload if is_session_workload(options.workload) else options.conversation
        self.plan = build_sessions(
            [Arrival(0.0)] * PLANNED_PER_USER,
            workload,
            input_len=options.input_len,
            output_len=options.output_len,
            seed=self.seed,
            shared_seed=SHARED_SEED,
        )
        self.sessions = itertools.cycle(self.plan.sessions)

    @task
    def converse(self) -> None:
        conversation = Conversation(self.plan, next(self.sessions))
        started_ts = time.perf_counter()
        for turn in range(self.plan.num_turns):
            if turn and self.plan.think_s:
                gevent.sleep(self.plan.think_s)
            record, answer = self.stream_request(
                conversation.request(turn, 0.0), ttft_name=f"turn {turn + 1}", keep_text=True
            )
            if record.outcome is not Outcome.OK:
                failure = CutShort(f"cut short at turn {turn + 1}: {record.outcome.value}")
                self._fire("SESSION", "conversation", time.perf_counter() - started_ts, length=turn, failure=failure)
                return
            conversation.add_answer(record, answer)
        self._fire("SESSION", "conversation", time.perf_counter() - started_ts, length=self.plan.num_turns)


class OpenLoopUser(BaseStreamUser):
    """One shard of kvstorm's seeded open-loop plan (``--arrival``, ``--num-requests`` / ``--duration``,
    ``--workload``, lengths, ``--seed``: the plan ``kvstorm bench serve`` sends): worker i of N sends requests i,
    i+N, ... at their planned instants from a zero the master sets, each in a greenlet of its own, whatever the
    others do; with no workers (a local run), one shard. One user per worker runs its worker's shard (run as many
    users as workers: more users on a worker stop at once). When its shard has ended the worker sends its records
    to the master, which writes kvstorm's results file and HTML report of the whole run (``--results-dir``) once
    every shard has sent them, and ends the run."""

    def on_start(self) -> None:
        super().on_start()
        self.start = OPEN_LOOP.wait_for_start()

    @task
    def send_shard(self) -> None:
        start = self.start
        if start is None or not OPEN_LOOP.claim_shard():
            raise StopUser()  # another user of this worker sends its shard (or this worker has none)
        plan = plan_run(_open_loop_config(self.environment, start.num_shards))
        plan = plan.shard(start.shard, start.num_shards)
        # The zero on this process's monotonic clock: the master's wall-clock zero, as far from now as it is here.
        run_start_ts = time.perf_counter() + (start.start_unix - time.time())
        streams = []
        for planned in plan.requests:
            gevent.sleep(max(0.0, run_start_ts + planned.offset_s - time.perf_counter()))
            streams.append(
                gevent.spawn(self.stream_request, planned, ttft_name=planned.path, run_start_ts=run_start_ts)
            )
        gevent.joinall(streams)
        records = [stream.value[0].model_dump(exclude={"tpot_s"}) for stream in streams if stream.successful()]
        errors = [f"{type(stream.exception).__name__}: {stream.exception}" for stream in streams if stream.exception]
        message = {"shard": start.shard, "records": records, "errors": errors}
        self.environment.runner.send_message(RECORDS_MESSAGE, message)
        raise StopUser()


class OpenLoopStart(NamedTuple):
    """What the master tells each worker at a run's start: its shard, how many there are, and the zero."""

    shard: int
    num_shards: int
    run_id: str
    start_unix: float


# The master's message to each worker at a run's start, and each worker's answer when its shard has ended (its
# records).
START_MESSAGE, RECORDS_MESSAGE = "kvstorm_open_loop_start", "kvstorm_open_loop_records"
# From the master's start to the zero: time for every worker to hear of it and plan its shard.
OPEN_LOOP_START_DELAY_S = 2.0


class _OpenLoopRun:
    """This process's part of the open-loop run in progress. A worker (or a local run): its start and whether a
    user took its shard. The master (or a local run): the run it started and the records each shard sent."""

    def __init__(self) -> None:
        self.start: OpenLoopStart | None = None
        self.shard_taken = False
        self.run: OpenLoopStart | None = None
        self.records: dict[int, list[dict]] = {}
        # Requests whose greenlet raised instead of returning a record (a bug, not an outcome), as the workers said.
        self.errors: list[str] = []
        self.written = False

    def wait_for_start(self) -> OpenLoopStart | None:
        """The start the master sent; None if none came in time (the worker joined after the run started)."""
        deadline = time.monotonic() + 5 * OPEN_LOOP_START_DELAY_S
        while self.start is None and time.monotonic() < deadline:
            gevent.sleep(0.05)
        return self.start

    def claim_shard(self) -> bool:
        """True for the first user of this process to ask (gevent: no other greenlet runs in between)."""
        claimed, self.shard_taken = not self.shard_taken, True
        return claimed


OPEN_LOOP = _OpenLoopRun()


def _open_loop_config(environment, num_shards: int = 1) -> RunConfig:
    """The run as ``kvstorm bench serve`` would be configured for it (the host the web UI may change included)."""
    options = environment.parsed_options
    return RunConfig(
        base_url=environment.host or "",
        model=model_of(environment),
        arrival=options.arrival,
        workload=options.workload,
        input_len=options.input_len,
        output_len=options.output_len,
        num_requests=options.num_requests,
        duration_s=parse_duration(options.duration) if options.duration else None,
        max_concurrency=None,
        request_timeout_s=parse_duration(options.request_timeout),
        stall_timeout_s=parse_duration(options.stall_timeout),
        retries=options.retries,
        exact_output=options.exact_output == "true",
        seed=options.seed,
        slo=None,
        workers=num_shards,
    )


@events.init.add_listener
def check_open_loop(environment, **_kwargs) -> None:
    """Listen for the open-loop run's messages (a worker hears of --arrival only from the master, when its users
    spawn), and refuse what the open-loop user cannot send before anything starts."""
    if environment.runner is not None:
        environment.runner.register_message(START_MESSAGE, _on_start_message)
        environment.runner.register_message(RECORDS_MESSAGE, _on_records_message)
    options = environment.parsed_options
    if options is None or options.worker:
        return
    if not 0 <= options.retries <= MAX_RETRIES:
        raise SystemExit(f"--retries must be in 0-{MAX_RETRIES}, got {options.retries}")
    if not options.arrival:
        if "OpenLoopUser" in options.user_classes:
            raise SystemExit("OpenLoopUser sends the schedule of --arrival: give one")
        if environment.available_user_classes:  # the web UI's class picker offers it for an open-loop run only
            environment.available_user_classes.pop("OpenLoopUser", None)
        return
    if is_session_workload(options.workload):
        raise SystemExit("--arrival sends single requests: multi-turn sessions are ConversationUser's")
    plan_run(_open_loop_config(environment))  # a bad schedule or workload fails here, with its error


@events.test_start.add_listener
def start_open_loop(environment, **_kwargs) -> None:
    """The master (or a local run) gives each worker its shard and the zero, before any user starts."""
    runner = environment.runner
    if environment.parsed_options is None or not environment.parsed_options.arrival:
        return
    if isinstance(runner, WorkerRunner):
        return
    OPEN_LOOP.records.clear()
    OPEN_LOOP.errors.clear()
    OPEN_LOOP.written = False
    run_id, start_unix = uuid.uuid4().hex[:8], time.time() + OPEN_LOOP_START_DELAY_S
    if not isinstance(runner, MasterRunner):
        OPEN_LOOP.run = OPEN_LOOP.start = OpenLoopStart(0, 1, run_id, start_unix)
        OPEN_LOOP.shard_taken = False
        return
    workers = sorted(node.id for node in (*runner.clients.ready, *runner.clients.spawning, *runner.clients.running))
    OPEN_LOOP.run = OpenLoopStart(-1, len(workers), run_id, start_unix)
    for shard, client_id in enumerate(workers):
        runner.send_message(START_MESSAGE, OpenLoopStart(shard, len(workers), run_id, start_unix)._asdict(), client_id)


def _on_start_message(environment, msg, **_kwargs) -> None:
    OPEN_LOOP.start, OPEN_LOOP.shard_taken = OpenLoopStart(**msg.data), False


def _on_records_message(environment, msg, **_kwargs) -> None:
    run = OPEN_LOOP.run
    if run is None or msg.data["shard"] not in range(run.num_shards):  # not a shard of this run: a late or stray one
        return
    OPEN_LOOP.records[msg.data["shard"]] = msg.data["records"]
    OPEN_LOOP.errors += msg.data["errors"]
    print(f"kvstorm: shard {msg.data['shard']} of {run.num_shards} sent {len(msg.data['records'])} records", flush=True)
    if len(OPEN_LOOP.records) == run.num_shards:
        _write_open_loop_results(environment)
        gevent.spawn_later(0.5, environment.runner.quit)


@events.quitting.add_listener
def write_what_arrived(environment, **_kwargs) -> None:
    """A run stopped before every shard sent its records (-t, the web UI's stop) still gets its results, which say
    which shards are missing."""
    if OPEN_LOOP.run is not None and OPEN_LOOP.records and not OPEN_LOOP.written:
        _write_open_loop_results(environment)


def _write_open_loop_results(environment) -> None:
    run, options = OPEN_LOOP.run, environment.parsed_options
    config = _open_loop_config(environment, run.num_shards)
    result = merged_result(config, run.run_id, run.start_unix, OPEN_LOOP.records, run.num_shards, OPEN_LOOP.errors)
    stem = Path(options.results_dir) / f"locust-{time.strftime('%Y%m%d-%H%M%S')}-{run.run_id}"
    result.write(stem.with_suffix(".json"))
    write_report(result, stem.with_suffix(".html"), title=f"kvstorm open loop over Locust {run.run_id}")
    OPEN_LOOP.written = True
    print(
        f"kvstorm: {len(result.records)} requests from {len(OPEN_LOOP.records)} of {run.num_shards} shards; "
        f"results: {stem.with_suffix('.json')}, report: {stem.with_suffix('.html')}",
        flush=True,
    )


class KvstormShape(LoadTestShape):
    """Delegates to :func:`loadgen.shapes.make_shape`; reads -u, -r and -t (``use_common_options``), which the web UI
    may change between runs, so the shape is rebuilt from the current options at every tick (once a second)."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        shape = make_shape(
            options.shape,
            default_users=options.num_users or 1,
            spawn_rate=options.spawn_rate,
            run_time_s=options.run_time or None,
        )
        return shape.tick(self.get_run_time())
