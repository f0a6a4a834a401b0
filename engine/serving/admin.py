"""``/admin/*``: run-time control behind a bearer token, the only way to change the engine while it serves.

The chaos harness drives these; they exist only when the server has an admin token.

Faults set with ``"lease_s": N`` in the body are all cleared when N seconds pass without another call that renews
the lease (``engine.core.fault_limits.FaultLease``): a harness that dies in the middle of an experiment leaves no
fault behind.
"""

from __future__ import annotations

import asyncio
import functools
import hmac

from aiohttp import web

from engine.core.fault_limits import FaultLease, FaultRequestError, parse_fault_request
from engine.serving.admin_exit import exit_handlers
from engine.serving.async_engine import AsyncEngine
from engine.serving.protocol import ADMIN_ROUTES, ApiError, route_definitions

MAX_STEPS = 10_000  # one /admin/step call; its handler waits for them all


async def run_off_loop(function, *args, **kwargs):
    """What waits for the engine's step in progress (describing it, changing its faults) runs off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(function, *args, **kwargs))


def add_admin_routes(app: web.Application, async_engine: AsyncEngine, token: str, obeys_exit: bool = False) -> None:
    """The routes, and the fault lease, which ends with the app. ``obeys_exit``: ``POST /admin/exit`` ends the
    process (``kvstorm serve --admin-exit``, engine.serving.admin_exit); else it is refused with a 403."""
    lease = FaultLease(async_engine.clear_faults)
    app.add_routes(_admin_routes(async_engine, token, lease, obeys_exit))

    async def end_lease(_: web.Application) -> None:
        lease.cancel()

    app.on_shutdown.append(end_lease)


async def _fault_changes(request: web.Request) -> tuple[dict[str, object], float | None]:
    """The faults a body asks to change, and its lease (None: no lease); ``ApiError`` 400 for a malformed one."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        raise ApiError(400, "the body must be a JSON object of faults") from None
    try:
        return parse_fault_request(body)
    except FaultRequestError as error:
        raise ApiError(400, str(error), error.param) from None


def _admin_routes(async_engine: AsyncEngine, token: str, lease: FaultLease, obeys_exit: bool) -> list[web.RouteDef]:
    def authorized(handler):
        async def check(request: web.Request) -> web.StreamResponse:
            # The header's own bytes: aiohttp keeps those that are not UTF-8 as surrogates, which match no token.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {token}".encode()):
                raise ApiError(401, "admin routes need 'Authorization: Bearer <admin token>'", error_type="auth_error")
            return await handler(request)

        return check

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(await run_off_loop(async_engine.describe))

    def with_lease(faults: dict[str, object]) -> web.Response:
        return web.json_response({**faults, "lease_s": lease.remaining_s})

    async def get_faults(_: web.Request) -> web.Response:
        return with_lease(await run_off_loop(async_engine.update_faults))

    async def set_faults(request: web.Request) -> web.Response:
        """Body: a JSON object of the faults to change (``engine.faults``, plus ``freeze``) and optionally
        ``lease_s``; answers with every fault's value and the lease left."""
        changes, lease_s = await _fault_changes(request)
        try:
            faults = await run_off_loop(async_engine.update_faults, **changes)
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        if lease_s is not None:
            lease.renew(lease_s)
        return with_lease(faults)

    async def clear_faults(_: web.Request) -> web.Response:
        lease.cancel()
        return with_lease(await run_off_loop(async_engine.clear_faults))

    async def pause(_: web.Request) -> web.Response:
        async_engine.pause()
        return web.json_response({"paused": True})

    async def resume(_: web.Request) -> web.Response:
        async_engine.resume()
        return web.json_response({"paused": False})

    async def step(request: web.Request) -> web.Response:
        try:
            num_steps = int(request.query.get("num_steps", "1"))
            if not 1 <= num_steps <= MAX_STEPS:
                raise ValueError(f"num_steps must be in [1, {MAX_STEPS}], got {num_steps}")
            await async_engine.step(num_steps)
        except ValueError as error:
            raise ApiError(400, str(error), "num_steps") from None
        return web.json_response({"num_iterations": async_engine.num_iterations})

    async def steps(_: web.Request) -> web.Response:
        return web.json_response({"steps": [timing.to_json() for timing in list(async_engine.iteration_log)]})

    async def reset_prefix_cache(_: web.Request) -> web.Response:
        return web.json_response(await run_off_loop(async_engine.reset_prefix_cache))

    handlers = {
        "stats": stats,
        "pause": pause,
        "resume": resume,
        "step": step,
        "steps": steps,
        "reset_prefix_cache": reset_prefix_cache,
    }
    handlers |= {"get_faults": get_faults, "set_faults": set_faults, "clear_faults": clear_faults}
    handlers |= exit_handlers(obeys_exit)
    return route_definitions(ADMIN_ROUTES, {name: authorized(handler) for name, handler in handlers.items()})
