"""The controller's HTTP API (FastAPI): experiments, runs and their live events, ad-hoc faults, metrics.

Everything but ``/health``, ``/metrics``, ``/docs`` and ``/openapi.json`` needs ``Authorization: Bearer <controller
token>``, checked before a body is read; a body is at most 64 KiB. The engine's admin token stays in the controller:
a caller of ``PUT /faults`` never sees or sends it. A run's overrides are typed and bounded per parameter (``GET
/experiments`` gives each schema); nothing a request carries is executed, resolved from the environment, or read as
a path outside the operator's ``--data-dir``: the kill-and-restart command is the operator's ``--server-command``
(or none, with ``--supervised-target``: the target exits when asked through its admin API, and its supervisor
starts it again).
Ad-hoc faults carry the engine's lease, renewed while the controller runs (``LeaseKeeper``): a controller that dies
leaves no fault behind for longer than ``lease_s``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, status
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from chaos.controller.guard import MAX_BODY_BYTES, Guard
from chaos.controller.metrics import ControllerMetrics
from chaos.controller.parameters import ParameterRefused, describe
from chaos.controller.runs import RunConflict, RunManager, RunStartFailed, TargetUnanswered
from chaos.injectors.engine_admin import AdminError, EngineAdmin, LeaseKeeper

EVENT_POLL_S = 0.2
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


@dataclass(frozen=True)
class ControllerConfig:
    target_url: str
    # None: the first model the target lists in /v1/models, asked at each run's start.
    model: str | None
    admin_token: str
    controller_token: str
    results_dir: Path
    max_run_s: float = 1800.0
    lease_s: float = 30.0
    # Each run's report links the dashboards drawn from this Prometheus over the run.
    prometheus_url: str | None = None
    # Where a run's file parameters (jsonl:path=, trace:path=) may resolve; None: they are refused.
    data_dir: Path | None = None
    # The command kill-and-restart starts (and kills) the target with: the operator's, never a request's.
    server_command: str | None = None
    # Or: the target's supervisor restarts it (compose's restart policy), and kill-and-restart asks it to exit
    # through its admin API (kvstorm serve --admin-exit; chaos.supervised_control).
    supervised_target: bool = False
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not self.admin_token or not self.controller_token:
            raise ValueError("the controller needs the engine's admin token and a controller token of its own")
        if self.max_run_s <= 0 or self.lease_s <= 0:
            raise ValueError(f"max_run_s and lease_s must be > 0, got {self.max_run_s}, {self.lease_s}")
        if self.server_command is not None and self.supervised_target:
            raise ValueError("a target is started by the server command or restarted by its supervisor, not both")

    @property
    def operator_values(self) -> dict[str, str]:
        """The operator's values of the experiments' operator parameters: no command for a supervised target."""
        if self.supervised_target:
            return {"server_command": ""}
        return {} if self.server_command is None else {"server_command": self.server_command}


class StartRun(BaseModel):
    model_config = ConfigDict(extra="forbid")

    experiment: str = Field(description="a name from GET /experiments")
    overrides: dict[str, Any] = Field(default_factory=dict, description="values of the experiment's parameters")


def create_app(config: ControllerConfig) -> FastAPI:
    metrics = ControllerMetrics(config.target_url)
    runs = RunManager(
        config.target_url,
        config.model,
        config.admin_token,
        config.results_dir,
        metrics,
        config.max_run_s,
        config.prometheus_url,
        data_dir=config.data_dir,
        operator_values=config.operator_values,
    )
    admin = EngineAdmin(config.target_url, config.admin_token)
    ad_hoc: dict[str, LeaseKeeper] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # SIGTERM (uvicorn's shutdown): the run stops with its rollbacks, and every fault this controller set goes.
        await asyncio.to_thread(runs.shutdown)
        if "faults" in ad_hoc:
            ad_hoc.pop("faults").stop()
        await asyncio.to_thread(runs.clear_engine_faults)

    app = FastAPI(
        title="kvstorm chaos controller",
        description=__doc__,
        lifespan=lifespan,
    )
    # Outermost: the token and the body's size are checked before FastAPI reads the body (the dependency below
    # stays for the OpenAPI page's "Authorize" and as a second check).
    app.add_middleware(Guard, token=config.controller_token, max_body_bytes=config.max_body_bytes)

    def authorized(credentials: Credentials) -> None:
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), config.controller_token.encode()):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "needs 'Authorization: Bearer <controller token>'")

    guarded = [Depends(authorized)]

    app.add_exception_handler(ParameterRefused, _parameter_refused)
    app.add_exception_handler(AdminError, _engine_refused)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        active = [run.id for run in runs.runs.values() if run.is_active]
        return {"status": "ok", "target": config.target_url, "active_run": active[0] if active else None}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(_run_routes(runs), dependencies=guarded)
    app.include_router(_run_output_routes(runs), dependencies=guarded)
    app.include_router(_fault_routes(config, admin, metrics, ad_hoc), dependencies=guarded)
    return app


async def _parameter_refused(_: Request, error: ParameterRefused) -> JSONResponse:
    return JSONResponse({"detail": str(error), "parameter": error.name, "reason": error.reason}, status_code=400)


async def _engine_refused(_: Request, error: AdminError) -> JSONResponse:
    # A fault value the engine refused is the caller's to fix; anything else is the engine's (a bad gateway).
    code = 400 if error.status == 400 else 502
    return JSONResponse({"detail": f"the engine refused: {error}"}, status_code=code)


def _run_routes(runs: RunManager) -> APIRouter:
    """The library, and runs of it: start, list, read, stop."""
    router = APIRouter()

    @router.get("/experiments")
    async def experiments() -> list[dict[str, Any]]:
        return [
            {
                "name": e.name,
                "title": e.title,
                "description": e.description,
                "parameters": e.parameters,
                "schema": describe(e.parameters),
                "operator_parameters": list(e.operator_parameters),
            }
            for e in runs.library.values()
        ]

    @router.post("/runs", status_code=status.HTTP_201_CREATED)
    async def start_run(body: StartRun) -> dict[str, Any]:
        if body.experiment not in runs.library:
            raise HTTPException(404, f"no experiment {body.experiment!r}; GET /experiments lists them")
        try:
            run = await asyncio.to_thread(runs.start, body.experiment, body.overrides)
        except RunConflict as error:
            raise HTTPException(409, str(error)) from None
        except RunStartFailed as error:
            raise HTTPException(500, str(error)) from None
        except TargetUnanswered as error:
            raise HTTPException(502, str(error)) from None
        return run.summary()

    @router.get("/runs")
    async def list_runs() -> list[dict[str, Any]]:
        return [run.summary() for run in runs.runs.values()]

    @router.get("/runs/{run_id}")
    async def get_run(run_id: str) -> dict[str, Any]:
        return _find(runs, run_id).summary()

    @router.delete("/runs/{run_id}")
    async def stop_run(run_id: str) -> dict[str, Any]:
        run = _find(runs, run_id)
        await asyncio.to_thread(runs.stop, run)
        return run.summary()

    return router


def _run_output_routes(runs: RunManager) -> APIRouter:
    """A run as it happens (its events) and after (its report)."""
    router = APIRouter()

    @router.get("/runs/{run_id}/events")
    async def run_events(run_id: str) -> StreamingResponse:
        """Server-Sent Events: every event of the run so far, then the new ones, until its end."""
        run = _find(runs, run_id)

        async def stream() -> AsyncIterator[bytes]:
            sent = 0
            while True:
                events = run.events[sent:]
                for event in events:
                    yield f"event: {event['type']}\ndata: {json.dumps(event, default=str)}\n\n".encode()
                sent += len(events)
                if events and events[-1]["type"] == "end":
                    return
                await asyncio.sleep(EVENT_POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @router.get("/runs/{run_id}/report")
    async def run_report(run_id: str) -> FileResponse:
        run = _find(runs, run_id)
        reports = sorted(run.results_dir.glob("*/report.html"))
        if not reports:
            raise HTTPException(404, f"run {run_id} has no report (yet): status {run.status}")
        return FileResponse(reports[-1], media_type="text/html")

    return router


def _find(runs: RunManager, run_id: str):
    run = runs.runs.get(run_id)
    if run is None:
        raise HTTPException(404, f"no run {run_id!r}")
    return run


def _fault_routes(
    config: ControllerConfig, admin: EngineAdmin, metrics: ControllerMetrics, ad_hoc: dict[str, LeaseKeeper]
) -> APIRouter:
    """Ad-hoc engine faults outside a run, under a lease this controller renews (``ad_hoc`` holds its keeper)."""
    router = APIRouter()

    @router.get("/faults")
    async def get_faults() -> dict[str, Any]:
        return await asyncio.to_thread(admin.faults)

    @router.put("/faults")
    async def put_faults(faults: dict[str, Any]) -> dict[str, Any]:
        """Change faults on the target engine (a JSON object of them, as its /admin/faults takes), under a lease
        this controller renews until the faults are cleared."""
        if "lease_s" in faults:
            raise HTTPException(400, f"the controller keeps the lease itself ({config.lease_s:g} s, renewed)")
        values = await asyncio.to_thread(admin.set_faults, faults, config.lease_s)
        if "faults" not in ad_hoc:
            ad_hoc["faults"] = LeaseKeeper(admin, config.lease_s)
        for name in faults:
            metrics.set_fault(f"engine:{name}", name in values["active"])
        return values

    @router.delete("/faults")
    async def clear_faults() -> dict[str, Any]:
        if "faults" in ad_hoc:
            await asyncio.to_thread(ad_hoc.pop("faults").stop)
        values = await asyncio.to_thread(admin.clear_faults)
        metrics.clear_faults()
        return values

    return router
