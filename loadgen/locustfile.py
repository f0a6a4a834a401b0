"""Locust front of the load generator: users that stream SSE from an OpenAI-compatible server.

    locust -f loadgen/locustfile.py --host http://127.0.0.1:8000 --model NAME            # web UI on :8089
    locust -f loadgen/locustfile.py --headless -u 20 -t 60s --host ... --model NAME --csv out
    locust -f loadgen/locustfile.py --master ...   +   locust -f loadgen/locustfile.py --worker   # distributed

Each request is reported four ways: the POST itself (Locust's own row: time to the response headers; failed when
the request was rejected or its stream broke), and our request types ``TTFT``, ``ITL`` (one sample per gap between
tokens) and ``E2E``, which show in the web UI and the CSV like any request. ``E2E`` fails for a broken stream or a
client timeout, with the reason. Users loop without waiting; the load is the number of users, which the shape
(``--shape``, ``$LOCUST_SHAPE``; see ``loadgen/shapes.py``) can burst, spike or step over time.

Streams are checked by the same tracker as ``kvstorm bench serve`` (SSE framing, finish reason, ``[DONE]``, usage
against tokens delivered). The read blocks, so a stall cannot be cut while it happens: a gap longer than
``--stall-timeout`` is reported when the stream ends, and a server that never answers hits ``--request-timeout``.
gevent lives only in this file's process: nothing else in ``loadgen`` imports locust. The web UI binds 127.0.0.1 by
default and asks for a login wherever it may be reached from another machine (``loadgen/web_login.py``).
"""

from __future__ import annotations

import itertools
import time
import uuid

import requests
from locust import HttpUser, LoadTestShape, constant, events, task
from urllib3.exceptions import ReadTimeoutError

from loadgen import web_login
from loadgen.arrivals import Arrival
from loadgen.records import Outcome, RequestRecord
from loadgen.shapes import make_shape
from loadgen.spec import parse_duration
from loadgen.tracker import StreamTracker
from loadgen.workloads import build_plan, request_body

PLANNED_PER_USER = 64


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    group = parser.add_argument_group("kvstorm")
    group.add_argument("--model", env_var="LOCUST_MODEL", default="default", help="model name the server expects")
    group.add_argument("--workload", env_var="LOCUST_WORKLOAD", default="chat", help="random, chat, jsonl:path=")
    group.add_argument("--input-len", env_var="LOCUST_INPUT_LEN", default="fixed:128", help="prompt tokens")
    group.add_argument("--output-len", env_var="LOCUST_OUTPUT_LEN", default="fixed:64", help="max_tokens")
    group.add_argument("--exact-output", env_var="LOCUST_EXACT_OUTPUT", choices=["true", "false"], default="true")
    group.add_argument("--shape", env_var="LOCUST_SHAPE", default="constant", help="constant, onoff:, spike:, step:")
    group.add_argument("--stall-timeout", env_var="LOCUST_STALL_TIMEOUT", default="30s")
    group.add_argument("--request-timeout", env_var="LOCUST_REQUEST_TIMEOUT", default="600s")
    web_login.add_arguments(parser)  # the web UI's login on where compose publishes it beyond loopback


@events.init.add_listener
def install_web_login(environment, web_ui=None, **_kwargs) -> None:
    web_login.install(web_ui)


class BrokenStream(Exception):
    """The E2E sample of a stream that did not end cleanly (broken stream or client timeout)."""


class StreamingUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        seed = uuid.uuid4().int % (1 << 31)
        arrivals = [Arrival(0.0)] * PLANNED_PER_USER
        plan = build_plan(
            arrivals, options.workload, input_len=options.input_len, output_len=options.output_len, seed=seed
        )
        exact = options.exact_output == "true"
        self.bodies = itertools.cycle(
            [(planned, request_body(planned, options.model, exact_output=exact)) for planned in plan]
        )
        self.stall_timeout_s = parse_duration(options.stall_timeout)
        self.request_timeout_s = parse_duration(options.request_timeout)

    @task
    def stream(self) -> None:
        planned, body = next(self.bodies)
        request_id = str(uuid.uuid4())  # a UUID: some servers refuse an X-Request-Id of any other shape
        sent_ts = time.perf_counter()
        tracker = StreamTracker(
            index=0,
            request_id=request_id,
            scheduled_s=0.0,
            sent_ts=sent_ts,
            run_start_ts=sent_ts,
            requested_output_tokens=planned.max_tokens,
            stall_timeout_s=self.stall_timeout_s,
        )
        with self.client.post(
            planned.path,
            json=body,
            headers={"X-Request-Id": request_id},
            stream=True,
            catch_response=True,
            timeout=self.request_timeout_s,
        ) as response:
            tracker.http_status = response.status_code
            if response.status_code != 200:
                response.failure(f"rejected: HTTP {response.status_code}")
                return
            record = self._read(response, tracker)
            if record.outcome is Outcome.OK:
                response.success()
            else:
                response.failure(f"{record.outcome.value}: {record.error}")
        self._report(planned.path, record)

    def _read(self, response: requests.Response, tracker: StreamTracker) -> RequestRecord:
        try:
            for chunk in response.iter_content(chunk_size=None):
                tracker.feed(chunk, time.perf_counter())
        except requests.exceptions.RequestException as error:
            # requests re-raises a read timeout inside iter_content as a ConnectionError wrapping urllib3's error.
            if isinstance(error, requests.exceptions.Timeout) or isinstance(
                error.args[0] if error.args else None, ReadTimeoutError
            ):
                message = f"no data for the request timeout ({self.request_timeout_s:g} s)"
                return tracker.finish(time.perf_counter(), Outcome.CLIENT_TIMEOUT, message)
            return tracker.finish(time.perf_counter(), Outcome.BROKEN_STREAM, f"{type(error).__name__}: {error}")
        return tracker.finish(time.perf_counter())

    def _report(self, name: str, record: RequestRecord) -> None:
        fire = self.environment.events.request.fire
        if record.ttft_s is not None:
            fire(
                request_type="TTFT",
                name=name,
                response_time=record.ttft_s * 1e3,
                response_length=0,
                exception=None,
                context={},
            )
        for gap_s in record.itl_s:
            fire(
                request_type="ITL", name=name, response_time=gap_s * 1e3, response_length=0, exception=None, context={}
            )
        failure = None if record.outcome is Outcome.OK else BrokenStream(f"{record.outcome.value}: {record.error}")
        fire(
            request_type="E2E",
            name=name,
            response_time=record.e2e_s * 1e3,
            response_length=record.output_tokens,
            exception=failure,
            context={},
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
