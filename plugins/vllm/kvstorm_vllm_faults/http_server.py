"""``GET | POST | DELETE /admin/faults`` over the standard library's HTTP server, on its own threads: kvstorm's routes,
bodies, statuses and error JSON (``{"error": {"message", "type", "param", "code"}}``), behind ``Authorization:
Bearer <token>`` compared in constant time. The token is never logged; nor is anything a request carries."""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvstorm_vllm_faults.fault_limits import FaultLease, FaultRequestError, parse_fault_request
from kvstorm_vllm_faults.service import FaultNotApplicable

logger = logging.getLogger("vllm.kvstorm_faults")
PATH = "/admin/faults"
MAX_BODY_BYTES = 64 * 1024


class Contract(Protocol):
    lease: FaultLease

    def answer(self) -> dict[str, Any]: ...

    def update(self, changes: dict[str, object]) -> dict[str, Any]: ...

    def clear(self) -> dict[str, Any]: ...


class ApiError(Exception):
    """An answer other than 200, as kvstorm's server words it."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.error_type = status, message, param, error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}


def start_server(contract: Contract, token: str, host: str, port: int) -> ThreadingHTTPServer:
    """Listen on ``host:port`` (``OSError`` if it cannot) and serve on a daemon thread until ``shutdown()``."""
    server = ThreadingHTTPServer((host, port), _handler_for(contract, f"Bearer {token}".encode()))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvstorm-faults-http", daemon=True).start()
    return server


def _handler_for(contract: Contract, expected_authorization: bytes) -> type[BaseHTTPRequestHandler]:
    class FaultsHandler(BaseHTTPRequestHandler):
        server_version = "kvstorm-vllm-faults"

        def do_GET(self) -> None:
            self._answer(contract.answer)

        def do_POST(self) -> None:
            self._answer(self._set_faults)

        def do_DELETE(self) -> None:
            self._answer(self._clear_faults)

        def do_PUT(self) -> None:  # http.server's own answer to a method without a handler is a 501, which here means
            self._answer(self._method_not_allowed)  # "not applicable"

        do_PATCH = do_PUT

        def _method_not_allowed(self) -> dict[str, Any]:
            raise ApiError(405, f"{PATH} takes GET, POST and DELETE")

        def _set_faults(self) -> dict[str, Any]:
            try:
                changes, lease_s = parse_fault_request(self._json_body())
                answer = contract.update(changes)
            except FaultRequestError as error:
                raise ApiError(400, str(error), error.param) from None
            except ValueError as error:
                raise ApiError(400, str(error)) from None
            if lease_s is not None:
                contract.lease.renew(lease_s)
                answer["lease_s"] = contract.lease.remaining_s
            return answer

        def _clear_faults(self) -> dict[str, Any]:
            contract.lease.cancel()
            return contract.clear()

        def _json_body(self) -> object:
            length = self.headers.get("Content-Length", "")
            if not length.isascii() or not length.isdigit():
                raise ApiError(411, "the body needs a Content-Length")
            if int(length) > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
            try:
                return json.loads(self.rfile.read(int(length)))
            except (ValueError, RecursionError):
                raise ApiError(400, "the body must be a JSON object of faults") from None

        def _answer(self, action) -> None:
            try:
                if self.path != PATH:
                    raise ApiError(404, f"not found: this server serves {PATH} only", error_type="not_found_error")
                self._check_token()
                status, body = 200, action()
            except ApiError as error:
                status, body = error.status, error.body()
            except FaultNotApplicable as error:
                status, body = 501, ApiError(501, str(error), error.param, "not_applicable").body()
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _check_token(self) -> None:
            # http.server reads header bytes as Latin-1: encoding them back gives the bytes as sent, and bytes that
            # are no UTF-8 match no token.
            given = self.headers.get("Authorization", "").encode("latin-1", "replace")
            if not hmac.compare_digest(given, expected_authorization):
                message = "admin routes need 'Authorization: Bearer <admin token>'"
                raise ApiError(401, message, error_type="auth_error")

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("faults http: " + format, *args)

    return FaultsHandler
