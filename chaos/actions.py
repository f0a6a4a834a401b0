"""Chaos Toolkit actions of the kvstorm extension (``provider: {type: python, module: chaos.actions, func: ...}``).

Each returns something JSON-able for the journal and records what it did (loads, fault windows) in the run's state
(``chaos.run.state``) for the probes and the verdict. Engine faults need kvstorm's fault contract (kvstorm's own
server, or kvstorm's plugin in a vLLM at ``faults_url``) and its admin token in ``$KVSTORM_ADMIN_TOKEN``; the rest
works against any OpenAI-compatible server.

- ``measure_target``: the server's capacity and KV size (``chaos.run.sizing``), for the loads sized from them;
- ``run_load``: the load generator, to the end of the load (declare it ``background: true`` so the faults that
  follow in the method happen during it); its rates can be multiples of the measured capacity and its request
  count a multiple of the measured KV size; a load can itself be the fault (``as_fault``: a flood of unrelated
  prompts that evicts a prefix cache, on any server);
- ``set_engine_faults`` / ``clear_engine_faults``: ``/admin/faults`` (``engine/faults.py``) with a lease, so the
  engine clears them by itself if this process dies;
- ``start_proxy`` / ``set_proxy_faults`` / ``reset_proxy_connections`` / ``clear_proxy_faults`` / ``stop_proxy``:
  network faults between the load and the server (``chaos.injectors.proxy``);
- ``disconnect_storm``: clients hanging up at a phase, then a leak check (``chaos.injectors.disconnects``);
- ``kill_server`` / ``restart_server``: the server this experiment started (``chaos.controls``);
- ``cpu_co_tenant`` / ``stop_cpu_co_tenants``: processes on this host that keep cores busy beside the server
  (``chaos.injectors.cpu_co_tenant``).
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from chaos.injectors.cpu_co_tenant import CoTenantSpec, CpuCoTenant, check_on_this_host
from chaos.injectors.disconnects import disconnect_storm as run_storm
from chaos.injectors.engine_admin import EngineAdmin, LeaseKeeper
from chaos.injectors.proxy import FaultProxy
from chaos.run import load as loads
from chaos.run.sizing import TargetSize, requests_for_kv
from chaos.run.sizing import measure_target as measure
from chaos.run.state import current
from loadgen.arrivals import scale_rates
from loadgen.plan import plan_size

# The most a load written in multiples of the measured capacity may ask for: a burst past what the server sustains,
# not a flood of the harness's own host.
MAX_CAPACITY_MULTIPLE = 20.0


def measure_target(
    target_url: str,
    model: str,
    workload: str = "random",
    input_len: str = "fixed:128",
    output_len: str = "fixed:64",
    concurrency: int = 8,
    num_requests: int = 16,
    rate_unit: str = "capacity",
) -> dict[str, Any]:
    """Read the server's KV size and measure its capacity with these request shapes (``chaos.run.sizing``); the
    loads that follow can be sized from them (``run_load``'s ``rate_unit`` and ``kv_multiple``). The experiments'
    loads give this their own ``rate_unit``: ``req/s`` (rates as written) or ``num_requests`` 0 reads the KV size
    only, and no request is sent."""
    if _rate_unit(rate_unit) == "req/s":
        num_requests = 0
    shapes = {"workload": workload, "input_len": input_len, "output_len": output_len}
    size = measure(target_url, model, shapes=shapes, concurrency=concurrency, num_requests=num_requests)
    current().target_size = size
    current().emit("target_size", **size.to_json())
    return size.to_json()


def run_load(
    target_url: str,
    model: str,
    arrival: str,
    duration_s: float | None = None,
    num_requests: int | None = None,
    workload: str = "random",
    input_len: str = "fixed:128",
    output_len: str = "fixed:64",
    max_concurrency: int | None = None,
    request_timeout_s: float = 300.0,
    stall_timeout_s: float = 30.0,
    seed: int = 0,
    name: str = "main",
    metrics_url: str | None = None,
    rate_unit: str = "req/s",
    kv_multiple: float | None = None,
    as_fault: bool = False,
) -> dict[str, Any]:
    """An open-loop load (``kvstorm bench serve``'s arrival, workload and length specs) run to its end.

    Sized from the target (after ``measure_target``): ``rate_unit: capacity`` reads every rate of ``arrival`` as a
    multiple of the measured capacity; ``kv_multiple`` sends as many requests as hold that many times the server's
    KV cache once fully generated (instead of ``num_requests``). ``as_fault``: the load is the experiment's fault
    (traffic that disrupts the main load), so its time is a fault window, ``traffic:NAME``."""
    if _rate_unit(rate_unit) == "capacity":
        capacity_rps = _measured().capacity_rps
        if capacity_rps is None:
            raise RuntimeError("rate_unit capacity: measure_target read only the KV size (num_requests 0)")
        # The bound on a caller's rates (the controller's, in req/s) would allow 200 times the capacity here.
        arrival = scale_rates(arrival, capacity_rps, max_rate=MAX_CAPACITY_MULTIPLE)
    if kv_multiple is not None:
        num_requests = requests_for_kv(_measured(), kv_multiple, input_len, output_len)
    config = loads.load_config(
        target_url,
        model,
        arrival,
        duration_s=duration_s,
        num_requests=num_requests,
        workload=workload,
        input_len=input_len,
        output_len=output_len,
        max_concurrency=max_concurrency,
        request_timeout_s=request_timeout_s,
        stall_timeout_s=stall_timeout_s,
        seed=seed,
    )
    # The controller sized the load as written; its rates or count from the server are known only now.
    plan_size(config).check()
    window = f"traffic:{name}"
    if as_fault:
        current().fault_on(window)
    try:
        load = loads.run_load(name, config, metrics_url)
    finally:
        current().fault_off(window)
    return {"arrival": arrival, "num_requests_cap": num_requests, **loads.summary_of(load.result)}


def _rate_unit(rate_unit: str) -> str:
    if rate_unit not in ("req/s", "capacity"):
        raise ValueError(f"rate_unit={rate_unit!r}: expected req/s or capacity")
    return rate_unit


def _measured() -> TargetSize:
    size = current().target_size
    if size is None:
        raise RuntimeError("this load is sized from the target: run measure_target earlier in the method")
    return size


def set_engine_faults(
    target_url: str, faults: dict[str, Any], lease_s: float = 30.0, faults_url: str = ""
) -> dict[str, Any]:
    """Change engine faults under a lease this process renews while it runs
    (``chaos.injectors.engine_admin.LeaseKeeper``): the rollbacks clear the faults, and if this process dies the
    engine clears them ``lease_s`` later. ``faults_url``: where the server's fault contract is when not at the
    target's own URL (kvstorm's plugin in a vLLM serves it on a port of its own); empty: the target's. ``freeze``
    gets its window from its own duration. Which faults are on is the server's word (its ``active``), not a rule of
    the harness's own."""
    url = faults_url or target_url
    admin = EngineAdmin(url)
    values = admin.set_faults(faults, lease_s=lease_s)
    state, now = current(), time.time()
    if url not in state.lease_keepers:
        state.lease_keepers[url] = LeaseKeeper(admin, lease_s)
    for name in faults:
        window = f"engine:{name}"
        if name in values["active"]:
            state.fault_on(window, now)
            if name == "freeze":
                state.fault_off(window, now + values["freeze"])
        else:
            state.fault_off(window, now)
    return values


def clear_engine_faults(target_url: str, faults_url: str = "") -> dict[str, Any]:
    """Every engine fault off (``faults_url`` as in ``set_engine_faults``), and the lease no longer renewed."""
    url = faults_url or target_url
    state = current()
    keeper = state.lease_keepers.pop(url, None)
    if keeper is not None:
        keeper.stop()
    values = EngineAdmin(url).clear_faults()
    now = time.time()
    for window in list(state.open_faults):
        if window.startswith("engine:"):
            state.fault_off(window, now)
    return values


def start_proxy(upstream_url: str, listen_port: int = 0, name: str = "proxy") -> dict[str, Any]:
    """A fault proxy in front of ``upstream_url``; point the load at the URL it returns."""
    parts = urlsplit(upstream_url)
    proxy = FaultProxy(parts.hostname or "127.0.0.1", parts.port or 80, listen_port=listen_port)
    port = proxy.start()
    current().proxies[name] = proxy
    return {"url": f"http://127.0.0.1:{port}", "port": port}


def set_proxy_faults(direction: str = "downstream", name: str = "proxy", **faults: Any) -> dict[str, Any]:
    """Network faults of one direction (``chaos.injectors.proxy.DirectionFaults``: latency_s, jitter_s,
    bandwidth_bytes_per_s, slice_bytes, stall, reset_after_bytes)."""
    values = current().proxies[name].set_faults(direction, **faults)
    window = f"network:{direction}"
    (current().fault_on if values.is_active else current().fault_off)(window)
    return {"direction": direction, **{key: getattr(values, key) for key in values.names()}}


def reset_proxy_connections(name: str = "proxy", wait_for_streams_s: float = 30.0) -> dict[str, Any]:
    """Reset every connection through the proxy, mid-stream: as soon as a response is streaming through it (up to
    ``wait_for_streams_s``; then whatever is open)."""
    proxy = current().proxies[name]
    deadline = time.monotonic() + wait_for_streams_s
    while proxy.num_streaming() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    num_streaming = proxy.num_streaming()
    now = time.time()
    num_reset = proxy.reset_connections()
    current().fault_on("network:reset", now)
    current().fault_off("network:reset", now + 0.5)  # an instant; half a second keeps it visible on the timeline
    return {"connections_reset": num_reset, "streaming": num_streaming}


def clear_proxy_faults(name: str = "proxy") -> dict[str, Any]:
    proxy = current().proxies.get(name)
    if proxy is not None:
        proxy.clear_faults()
    for direction in ("upstream", "downstream"):
        current().fault_off(f"network:{direction}")
    return {"cleared": proxy is not None}


def stop_proxy(name: str = "proxy") -> dict[str, Any]:
    proxy = current().proxies.pop(name, None)
    if proxy is not None:
        proxy.stop()
    return {"stopped": proxy is not None}


def disconnect_storm(
    target_url: str,
    model: str,
    phase: str,
    num_requests: int = 8,
    prompt_len: int = 256,
    max_tokens: int = 32,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """``num_requests`` clients hang up at ``phase``; then the server must return to its queues and KV usage of
    before the storm (``chaos.injectors.disconnects``)."""
    window = f"disconnects:{phase}"
    current().fault_on(window)
    try:
        report = run_storm(
            target_url,
            model,
            phase,
            num_requests=num_requests,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            timeout_s=timeout_s,
        )
    finally:
        current().fault_off(window)
    current().storms.append(report)
    return report.to_json()


def cpu_co_tenant(target_url: str, cores: int = 1, duty_cycle: float = 1.0, duration_s: float = 30.0) -> dict[str, Any]:
    """Processes on this host that keep ``cores`` cores busy ``duty_cycle`` of the time for ``duration_s``, beside a
    server on this host (``target_url`` on loopback), to their end (``background: true`` runs it during the load):
    the fault window ``cpu:co-tenant``. Bounded and leased by ``chaos.injectors.cpu_co_tenant``."""
    check_on_this_host(target_url)
    co_tenant = CpuCoTenant(CoTenantSpec(int(cores), float(duty_cycle), float(duration_s)))
    state = current()
    state.co_tenants.append(co_tenant)
    state.fault_on("cpu:co-tenant")
    co_tenant.start()
    try:
        co_tenant.wait()
    finally:
        co_tenant.stop()
        state.fault_off("cpu:co-tenant")
    spec = co_tenant.spec
    return {"cores": spec.cores, "duty_cycle": spec.duty_cycle, "duration_s": spec.duration_s}


def stop_cpu_co_tenants() -> dict[str, Any]:
    """Every co-tenant this run started stopped (the rollback); how many processes were still running."""
    state = current()
    stopped = sum(co_tenant.stop() for co_tenant in state.co_tenants)
    state.fault_off("cpu:co-tenant")
    return {"processes_stopped": stopped}


def kill_server(signal_name: str = "SIGKILL") -> dict[str, Any]:
    """Kill the server this experiment started (``chaos.controls``) with SIGTERM or SIGKILL."""
    server = current().managed_server
    if server is None:
        raise RuntimeError("kill_server needs a server the experiment started (the chaos.controls control)")
    current().fault_on("server:down")
    return {"signal": signal_name, "exit_s": round(server.kill(signal_name), 3)}


def restart_server(timeout_s: float = 300.0) -> dict[str, Any]:
    """Start the killed server again; returns the seconds it took to be ready."""
    server = current().managed_server
    if server is None:
        raise RuntimeError("restart_server needs a server the experiment started (the chaos.controls control)")
    ready_s = server.start(timeout_s)
    current().fault_off("server:down")
    current().restarts.append(ready_s)
    return {"time_to_ready_s": round(ready_s, 2)}
