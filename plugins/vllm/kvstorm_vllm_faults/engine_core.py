"""kvstorm's faults inside vLLM's engine core, each acting on what vLLM really has (read against vLLM 0.32.0's
``vllm/v1/engine/core.py``, its scheduler and ``vllm/v1/core/block_pool.py``; ``register`` refuses other versions):

=============================  ======================================================================================
fault                          what the engine core's own thread does, at a step boundary
=============================  ======================================================================================
``kv_cap``                     takes blocks out of ``scheduler.kv_cache_manager.block_pool`` as a co-tenant would
                               (``get_new_blocks``: the free queue's least recently used first, evicting the prefix
                               cache's blocks as vLLM's own allocations do), more at each boundary as blocks free up,
                               until the cap holds; gives them back (``free_blocks``) when the cap is lifted. vLLM's
                               scheduler then preempts by recompute; its ``kv_cache_usage_perc`` counts them as used
``step_delay``                 sleeps before each step
``freeze``                     stops stepping until the freeze ends or is cleared
``fail_next_steps``,           the step's ``execute_model`` goes to the workers as a call that raises
``oom_above_batched_tokens``   ``torch.OutOfMemoryError`` there, so the error comes back through vLLM's own executor
                               as a real one does; whatever vLLM does next is the finding
``swap_cap``,                  NOT APPLICABLE (``service.not_applicable_faults``): a 501 naming the fault and why
``swap_delay_per_block``,
``memory_hog``
=============================  ======================================================================================

The block pool is not thread-safe: the HTTP threads only record what is wanted (``service.FaultService``) and wake
an idle engine core (vLLM's own ``WAKEUP`` request and idle callbacks); the engine core's thread does the rest.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc

from kvstorm_vllm_faults.fault_limits import DELAY_SLICE_S, PoolCap, sleep_while_wanted
from kvstorm_vllm_faults.http_server import start_server
from kvstorm_vllm_faults.service import FaultService, not_applicable_faults
from kvstorm_vllm_faults.settings import FaultSettings

logger = logging.getLogger("vllm.kvstorm_faults")


def install(settings: FaultSettings) -> None:
    """Wrap ``EngineCoreProc.run_busy_loop`` (once): the process that runs the engine core's loop serves the faults
    of that engine core, and no other process serves any."""
    original = EngineCoreProc.run_busy_loop
    if getattr(original, "kvstorm_faults", False):
        return

    @functools.wraps(original)
    def run_busy_loop(core: EngineCoreProc) -> None:
        faults = CoreFaults.attach(core, settings)
        try:
            original(core)
        finally:
            if faults is not None:
                faults.detach()

    run_busy_loop.kvstorm_faults = True  # type: ignore[attr-defined]
    EngineCoreProc.run_busy_loop = run_busy_loop


def raise_out_of_memory(worker: object, message: str) -> None:
    """Sent to the workers in place of a step's ``execute_model``: fails there as a forward pass out of memory does."""
    import torch

    raise torch.OutOfMemoryError(message)


class BlockHold:
    """Blocks of vLLM's pool held as a co-tenant holds device memory. Block 0 is vLLM's null block, never handed
    out: the pool's usable blocks are the others, and a cap counts those."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.blocks: list[Any] = []

    @property
    def num_usable(self) -> int:
        return self.pool.num_gpu_blocks - 1

    def follow(self, cap: PoolCap | None) -> bool:
        """Hold what ``cap`` takes away, as much of it as is free now, or give back what it no longer takes; True
        when the pool changed."""
        num_wanted = 0 if cap is None else self.num_usable - cap.num_blocks(self.num_usable)
        if num_wanted < len(self.blocks):
            self.pool.free_blocks(self.blocks[num_wanted:])
            del self.blocks[num_wanted:]
            return True
        num_taken = min(num_wanted - len(self.blocks), self.pool.get_num_free_blocks())
        if num_taken:
            self.blocks += self.pool.get_new_blocks(num_taken)
        return num_taken > 0


class CoreFaults:
    """One engine core's faults: its ``FaultService``, its HTTP server, and the wrapped step and executor."""

    def __init__(self, core: EngineCoreProc) -> None:
        self.core = core
        self.hold = BlockHold(core.scheduler.kv_cache_manager.block_pool)
        connector = core.vllm_config.kv_transfer_config
        self.service = FaultService(not_applicable_faults(connector and connector.kv_connector), self._wake)
        self.server: Any = None

    @classmethod
    def attach(cls, core: EngineCoreProc, settings: FaultSettings) -> CoreFaults | None:
        """Serve ``/admin/faults`` for ``core`` and wrap its step and executor; None (and vLLM serves on without
        faults) when the port cannot be had."""
        faults = cls(core)
        try:
            faults.server = start_server(faults.service, settings.token, settings.host, settings.port)
        except OSError as error:
            logger.error("kvstorm faults: OFF, cannot listen on %s:%d: %s", settings.host, settings.port, error)
            return None
        core.step_fn = faults._wrap_step(core.step_fn)
        executor = core.model_executor
        executor.execute_model = faults._wrap_execute_model(executor, executor.execute_model)
        faults._publish_engine()
        logger.info(
            "kvstorm faults: serving /admin/faults on http://%s:%d for this engine core (%d KV blocks)",
            settings.host,
            settings.port,
            faults.hold.num_usable,
        )
        return faults

    def detach(self) -> None:
        self.service.lease.cancel()
        self.server.shutdown()

    def _wrap_step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def step_with_faults() -> Any:
            while (left_s := self.service.freeze_left_s()) is not None:
                time.sleep(min(left_s, DELAY_SLICE_S))
            sleep_while_wanted(self.service.wanted_step_delay_s)
            self.hold.follow(self.service.wanted_kv_cap())
            outputs = step()
            self._publish_engine()  # after the step, which frees the blocks of the requests it finished
            return outputs

        return step_with_faults

    def _wrap_execute_model(self, executor: Any, execute_model: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model_with_faults(scheduler_output: Any, non_block: bool = False) -> Any:
            num_tokens = scheduler_output.total_num_scheduled_tokens
            failure = self.service.take_step_failure(num_tokens) if num_tokens else None  # no forward pass, no OOM
            if failure is None:
                return execute_model(scheduler_output, non_block=non_block)
            logger.warning("kvstorm faults: a step of %d tokens fails in the workers: %s", num_tokens, failure)
            return executor.collective_rpc(raise_out_of_memory, args=(failure,), non_block=non_block)

        return execute_model_with_faults

    def _publish_engine(self) -> None:
        pool = self.hold.pool
        self.service.publish_engine(
            num_kv_blocks=self.hold.num_usable,
            num_free_kv_blocks=pool.get_num_free_blocks(),
            num_kv_blocks_held=len(self.hold.blocks),
            kv_cache_usage=round(pool.get_usage(), 4),
        )

    def _wake(self) -> None:
        """From an HTTP thread: have the engine core's thread act on the faults now, even if it is idle (its loop
        then waits on its input queue: a ``WAKEUP`` ends the wait, and it runs its idle callbacks before waiting
        again). A busy engine core acts at its next step anyway."""
        if self._on_idle not in self.core._idle_state_callbacks:
            self.core._idle_state_callbacks.append(self._on_idle)
        self.core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _on_idle(self, core: EngineCoreProc) -> None:
        """In the engine core's thread, with no request in it. vLLM publishes its stats only with a step's outputs:
        when the pool changed here, the stats go out as vLLM's data-parallel idle loop sends them, so that
        ``vllm:kv_cache_usage_perc`` shows a cap set or lifted on an idle server."""
        if not self.hold.follow(self.service.wanted_kv_cap()):
            return
        self._publish_engine()
        if (stats := core.scheduler.make_stats()) is not None:
            core.output_queue.put_nowait((0, EngineCoreOutputs(scheduler_stats=stats)))
