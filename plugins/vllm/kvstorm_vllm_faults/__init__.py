"""kvstorm's fault contract (``GET | POST | DELETE /admin/faults``) served from inside vLLM: a vLLM general plugin.

vLLM calls ``register`` in every process it starts (its API server, its engine core, its workers). It does nothing
unless the operator set ``$KVSTORM_FAULTS_TOKEN`` (``settings``). Then, on the vLLM version it was written and
tested against (``TESTED_VLLM_VERSION``), it wraps the engine core's loop so that the engine core's process serves
the faults on ``$KVSTORM_FAULTS_HOST:$KVSTORM_FAULTS_PORT`` (127.0.0.1:8100 by default) and raises them at its step
boundaries (``engine_core``). On any other version it patches nothing: it logs why at start-up and answers every
``/admin/faults`` call with a 501 that says so, from the first process that can listen on the port.
"""

from __future__ import annotations

import logging
import os

from kvstorm_vllm_faults.settings import FaultSettings

logger = logging.getLogger("vllm.kvstorm_faults")
TESTED_VLLM_VERSION = "0.32.0"


def register() -> None:
    """vLLM's entry point (group ``vllm.general_plugins``); safe to call more than once in a process."""
    try:
        settings = FaultSettings.from_environ(os.environ)
    except ValueError as error:
        logger.error("kvstorm faults: OFF: %s", error)
        return
    if settings is None:
        return
    problem = version_problem(installed_vllm_version())
    if problem is not None:
        logger.error("kvstorm faults: REFUSED: %s", problem)
        serve_refusal(settings, problem)
        return
    from kvstorm_vllm_faults.engine_core import install  # imports vLLM's engine core: only on the version it knows

    install(settings)


def installed_vllm_version() -> str:
    from vllm.version import __version__

    return __version__


def version_problem(version: str) -> str | None:
    """Why the plugin must not touch this vLLM, or None on the version it was written against."""
    if version == TESTED_VLLM_VERSION:
        return None
    return (
        f"this plugin was written and tested against vLLM {TESTED_VLLM_VERSION} and reaches into its engine core's "
        f"internals; this is vLLM {version}, so nothing was patched and no fault can be injected"
    )


def serve_refusal(settings: FaultSettings, reason: str) -> None:
    """Answer ``/admin/faults`` with the 501 from the first of vLLM's processes that can listen on the port (the
    others find it taken, which is expected)."""
    from kvstorm_vllm_faults.http_server import start_server
    from kvstorm_vllm_faults.service import Refusal

    try:
        start_server(Refusal(reason), settings.token, settings.host, settings.port)
    except OSError as error:
        logger.debug("kvstorm faults: the refusal is served by another process (%s)", error)
