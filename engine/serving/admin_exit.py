"""``/admin/exit``: the process ends, for its supervisor to start it again.

How ``kill-and-restart`` kills a server it did not start: in a container stack nothing outside the engine's container
may signal its process, but compose's restart policy (or systemd's, or Kubernetes') starts it again once it exits.
``POST /admin/exit`` answers 202, sends it in full, then ends the process as SIGKILL would (at once: the streams in
flight are cut and nothing drains, as after the OOM killer) or as SIGTERM would (``kvstorm serve`` drains, then
exits 0). The server obeys only when its operator started it with ``--admin-exit``, behind the admin token like every
``/admin`` route; ``GET /admin/exit`` says whether it would. Nothing a caller sends is run: the body names one of two
signals.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine.serving.protocol import ApiError

logger = logging.getLogger(__name__)
# What a supervisor sees of a process SIGKILL ended (128 + 9: docker's 137): restart policies treat it as a crash.
EXIT_KILLED = 128 + signal.SIGKILL
EXIT_SIGNALS = ("SIGKILL", "SIGTERM")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def exit_handlers(obeys_exit: bool) -> dict[str, Handler]:
    """The handlers of ``GET`` and ``POST /admin/exit`` (``exit_state``, ``exit``), for the admin routes to guard."""

    async def exit_state(_: web.Request) -> web.Response:
        return web.json_response({"enabled": obeys_exit, "signals": list(EXIT_SIGNALS) if obeys_exit else []})

    async def exit_process(request: web.Request) -> web.StreamResponse:
        if not obeys_exit:
            raise ApiError(403, "this server was started without --admin-exit: nothing would start it again")
        signal_name = await _exit_signal(request)
        response = web.json_response({"exiting": True, "signal": signal_name}, status=202)
        # Sent in full before the process goes: the caller learns the exit was taken, not a broken connection.
        await response.prepare(request)
        await response.write_eof()
        _exit_as(signal_name)
        return response

    return {"exit_state": exit_state, "exit": exit_process}


async def _exit_signal(request: web.Request) -> str:
    """The signal the body names (no body: SIGKILL); ``ApiError`` 400 for any other body."""
    if not request.can_read_body:
        return "SIGKILL"
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        raise ApiError(400, 'the body must be a JSON object such as {"signal": "SIGKILL"}') from None
    if not isinstance(body, dict) or set(body) - {"signal"} or body.get("signal", "SIGKILL") not in EXIT_SIGNALS:
        raise ApiError(400, f'the body takes only "signal", one of {", ".join(EXIT_SIGNALS)}', "signal")
    return body.get("signal", "SIGKILL")


def _exit_as(signal_name: str) -> None:
    logger.warning("exiting as an admin asked (as %s): its supervisor is to start it again", signal_name)
    if signal_name == "SIGKILL":
        # No handler, no finally, no drain: what a killed process leaves behind is the point of the experiment.
        os._exit(EXIT_KILLED)
    # kvstorm serve's own SIGTERM handling: /ready turns 503, the streams in flight finish, the process exits 0.
    signal.raise_signal(signal.SIGTERM)
