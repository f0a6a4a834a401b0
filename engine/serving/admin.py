"""``/admin/*``: run-time control behind a bearer token, the only way to change the engine while it serves.

The chaos harness drives these; they exist only when the server has an admin token.
"""

from __future__ import annotations

import asyncio
import functools
import hmac

from aiohttp import web

from engine.serving.async_engine import AsyncEngine
from engine.serving.protocol import ApiError


def admin_routes(async_engine: AsyncEngine, token: str) -> list[web.RouteDef]:
    def authorized(handler):
        async def check(request: web.Request) -> web.StreamResponse:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise ApiError(401, "admin routes need 'Authorization: Bearer <admin token>'", error_type="auth_error")
            return await handler(request)

        return check

    async def stats(_: web.Request) -> web.Response:
        # describe() waits for the step in progress: off the event loop.
        description = await asyncio.get_running_loop().run_in_executor(None, async_engine.describe)
        return web.json_response(description)

    async def get_faults(_: web.Request) -> web.Response:
        faults = await asyncio.get_running_loop().run_in_executor(None, async_engine.update_faults)
        return web.json_response(faults)

    async def set_faults(request: web.Request) -> web.Response:
        """Body: a JSON object of the faults to change (``engine.faults.StepFaults``); answers with them all."""
        try:
            changes = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be a JSON object of faults") from None
        if not isinstance(changes, dict):
            raise ApiError(400, "the body must be a JSON object of faults")
        try:
            faults = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(async_engine.update_faults, **changes)
            )
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        return web.json_response(faults)

    async def pause(_: web.Request) -> web.Response:
        async_engine.pause()
        return web.json_response({"paused": True})

    async def resume(_: web.Request) -> web.Response:
        async_engine.resume()
        return web.json_response({"paused": False})

    async def step(request: web.Request) -> web.Response:
        try:
            num_steps = int(request.query.get("num_steps", "1"))
            if num_steps < 1:
                raise ValueError(f"num_steps must be >= 1, got {num_steps}")
            await async_engine.step(num_steps)
        except ValueError as error:
            raise ApiError(400, str(error), "num_steps") from None
        return web.json_response({"num_iterations": async_engine.num_iterations})

    return [
        web.get("/admin/stats", authorized(stats)),
        web.post("/admin/pause", authorized(pause)),
        web.post("/admin/resume", authorized(resume)),
        web.post("/admin/step", authorized(step)),
        web.get("/admin/faults", authorized(get_faults)),
        web.post("/admin/faults", authorized(set_faults)),
    ]
