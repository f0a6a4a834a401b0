"""The three dashboards: Engine (what the engine does), SLO (whether it keeps its promises, from the SLO spec) and
Chaos (what the harness did to it and what its clients saw). Queries use vLLM's names where one exists, so the
dashboards work on a vLLM server too (there a kvstorm-only panel has no data, and ``kvstorm dashboards render``
names the series the server does not export)."""

from __future__ import annotations

from collections.abc import Sequence

from dashboards.panels import RATE, SEL, Board, Panel, Query, heatmap, quantile_query, quantiles, rate_by
from dashboards.rules import guardrail_record
from dashboards.slo import BUDGET_WINDOW, Slo

GREEN, ORANGE, RED = "green", "orange", "red"


def engine_board() -> Board:
    return Board(
        uid="kvstorm-engine",
        title="kvstorm: engine",
        description="Queues, KV pools, preemption and swap, steps, latency and outcomes of an engine",
        rows=(
            ("Queues and KV", _queue_and_kv_panels()),
            ("Prefix cache", _prefix_cache_panels()),
            ("Preemption and swap", _preemption_panels()),
            ("Steps and throughput", _step_panels()),
            ("Latency", _latency_panels()),
            ("Admission", _admission_panels()),
            ("Outcomes", _outcome_panels()),
        ),
    )


def _queue_and_kv_panels() -> tuple[Panel, ...]:
    queues = Panel(
        "Requests running, waiting and swapped",
        tuple(Query(f"sum(vllm:num_requests_{state}{{{SEL}}})", state) for state in ("running", "waiting", "swapped")),
        unit="short",
    )
    kv_usage = Panel(
        "KV cache usage (device, host)",
        (
            Query(f"max(vllm:kv_cache_usage_perc{{{SEL}}})", "device"),
            Query(f"max(vllm:cpu_cache_usage_perc{{{SEL}}})", "host"),
        ),
        unit="percentunit",
        description="Of the usable pool: under a kv_cap fault, 100% is the capped size (kvstorm:kv_cap_fraction)",
    )
    blocks = Panel(
        "KV blocks per pool: usable and free, and the cap",
        (
            Query(f"sum by (pool) (kvstorm:total_blocks{{{SEL}}})", "usable {{pool}}"),
            Query(f"sum by (pool) (kvstorm:free_blocks{{{SEL}}})", "free {{pool}}"),
            Query(f"min by (pool) (kvstorm:kv_cap_fraction{{{SEL}}})", "cap fraction {{pool}}"),
        ),
        unit="short",
        right_axis=("cap fraction device", "cap fraction host"),
        right_unit="percentunit",
    )
    faults = Panel(
        "Active faults",
        (Query(f"max by (fault) (kvstorm:active_faults{{{SEL}}})", "{{fault}}"),),
        kind="state",
        description="1 while a fault is on (engine faults through /admin/faults)",
    )
    return queues, kv_usage, blocks, faults


def _prefix_cache_panels() -> tuple[Panel, ...]:
    hit_rate = Panel(
        "Prefix cache hit rate against KV usage and preemptions",
        (
            Query(
                f"sum(rate(vllm:prefix_cache_hits_total{{{SEL}}}[{RATE}])) "
                f"/ sum(rate(vllm:prefix_cache_queries_total{{{SEL}}}[{RATE}]))",
                "hit rate (prompt tokens)",
            ),
            Query(f"max(vllm:kv_cache_usage_perc{{{SEL}}})", "KV usage"),
            Query(f"sum(rate(vllm:num_preemptions_total{{{SEL}}}[{RATE}]))", "preemptions/s"),
        ),
        unit="percentunit",
        right_axis=("preemptions/s",),
        right_unit="ops",
        description="Hits and queries in prompt tokens looked up at admission (vLLM's counters); no data while "
        "no prompt arrives. A burst that fills the pool evicts the cache: the hit rate falls as usage and "
        "preemptions climb",
    )
    blocks = Panel(
        "Prefix cache blocks (held, evictable) and evictions per second",
        (
            Query(f"sum by (state) (kvstorm:prefix_cache_blocks{{{SEL}}})", "{{state}}"),
            Query(f"sum(rate(kvstorm:prefix_cache_evictions_total{{{SEL}}}[{RATE}]))", "evictions/s"),
        ),
        unit="short",
        right_axis=("evictions/s",),
        right_unit="ops",
        description="Cached blocks held by requests, and evictable ones (no request holds them; counted as free)",
    )
    return hit_rate, blocks


def _preemption_panels() -> tuple[Panel, ...]:
    preemptions = Panel(
        "Preemptions per second, by mode and reason",
        (
            Query(f"sum by (mode, reason) (rate(kvstorm:preemptions_total{{{SEL}}}[{RATE}]))", "{{mode}} {{reason}}"),
            Query(f"sum(rate(vllm:num_preemptions_total{{{SEL}}}[{RATE}]))", "all"),
        ),
        unit="ops",
    )
    swap = Panel(
        "KV blocks swapped per second, and tokens recomputed",
        (
            Query(f"sum by (direction) (rate(kvstorm:swap_blocks_total{{{SEL}}}[{RATE}]))", "blocks {{direction}}"),
            Query(f"sum(rate(kvstorm:recomputed_tokens_total{{{SEL}}}[{RATE}]))", "recomputed tokens"),
        ),
        unit="ops",
    )
    return (
        preemptions,
        swap,
        quantiles("kvstorm:swap_latency_seconds", "Swap latency of a step that swapped"),
        rate_by("kvstorm:failed_steps_total", "error", "Failed steps per second (the engine backs off)"),
    )


def _step_panels() -> tuple[Panel, ...]:
    tokens = Panel(
        "Prompt and generation tokens per second",
        (
            Query(f"sum(rate(vllm:prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt"),
            Query(f"sum(rate(vllm:generation_tokens_total{{{SEL}}}[{RATE}]))", "generation"),
        ),
        unit="ops",
    )
    batch = Panel(
        "Tokens per step (p50, p99) and the step's limit",
        (
            Query(f"histogram_quantile(0.5, sum by (le) (rate(kvstorm:batch_tokens_bucket{{{SEL}}}[{RATE}])))", "p50"),
            Query(f"histogram_quantile(0.99, sum by (le) (rate(kvstorm:batch_tokens_bucket{{{SEL}}}[{RATE}])))", "p99"),
            Query(f'min(kvstorm:batch_limit{{{SEL}, of="tokens"}})', "limit (less while backing off)"),
        ),
        unit="short",
    )
    return quantiles("kvstorm:step_duration_seconds", "Step duration"), batch, tokens


def _latency_panels() -> tuple[Panel, ...]:
    return (
        quantiles("vllm:time_to_first_token_seconds", "Time to first token"),
        quantiles("vllm:inter_token_latency_seconds", "Inter-token latency"),
        quantiles("vllm:e2e_request_latency_seconds", "End-to-end request latency"),
        quantiles("vllm:request_queue_time_seconds", "Queue time (arrival to first scheduled)"),
        heatmap("vllm:time_to_first_token_seconds", "Time to first token, heatmap"),
        heatmap("vllm:inter_token_latency_seconds", "Inter-token latency, heatmap"),
    )


def _admission_panels() -> tuple[Panel, ...]:
    predicted_vs_observed = Panel(
        "Admission: predicted and observed time to first token",
        tuple(
            quantile_query(histogram, q, f"{what} ")
            for histogram, what in (
                ("kvstorm:admission_predicted_ttft_seconds", "predicted"),
                ("vllm:time_to_first_token_seconds", "observed"),
            )
            for q in (0.5, 0.99)
        ),
        unit="s",
        description="What admission control predicted for the requests it admitted, against what they got",
    )
    ratio = "kvstorm:admission_ttft_prediction_ratio"
    prediction_accuracy = Panel(
        "Admission: predictions within 25% of the observed TTFT",
        (
            Query(
                f'(sum(rate({ratio}_bucket{{{SEL}, le="1.25"}}[{RATE}])) - sum(rate({ratio}_bucket{{{SEL}, le="0.75"}}'
                f"[{RATE}]))) / sum(rate({ratio}_count{{{SEL}}}[{RATE}]))",
                "within 25%",
            ),
        ),
        unit="percentunit",
        description="Predicted over observed first-token time between 0.75 and 1.25 (the target: 90%)",
    )
    admissions = Panel(
        "Admitted and refused per second",
        (
            Query(f"sum(rate(kvstorm:admitted_requests_total{{{SEL}}}[{RATE}]))", "admitted"),
            Query(f"sum by (reason) (rate(kvstorm:rejected_requests_total{{{SEL}}}[{RATE}]))", "refused {{reason}}"),
            Query(
                f"sum by (outcome) (rate(kvstorm:admission_retries_total{{{SEL}}}[{RATE}]))",
                "retry after Retry-After: {{outcome}}",
            ),
        ),
        unit="ops",
        description="A retry is the same request sent again after the Retry-After it was given",
    )
    margin = Panel(
        "Admission's learnt correction and limit",
        (
            Query(f"max by (quantile) (kvstorm:admission_correction{{{SEL}}})", "observed / model, q{{quantile}}"),
            Query(f"min(kvstorm:admission_ttft_limit_seconds{{{SEL}}})", "model TTFT limit"),
        ),
        unit="short",
        right_axis=("model TTFT limit",),
        right_unit="s",
        description="The feedback loop: how much slower (above 1) or faster than its step model the engine "
        "delivers first tokens, and the model's TTFT under which a request is admitted (objective / q0.95)",
    )
    decision_time = quantiles(
        "kvstorm:admission_decision_seconds",
        "Admission: time to decide on a request",
        description="Each decision runs the scheduler ahead of the engine, on the server's event loop: it grows with "
        "the requests and blocks in flight, and every stream waits while it runs",
    )
    return predicted_vs_observed, prediction_accuracy, admissions, margin, decision_time


def _outcome_panels() -> tuple[Panel, ...]:
    return (
        rate_by("vllm:request_success_total", "finished_reason", "Finished requests per second by reason"),
        rate_by("kvstorm:rejected_requests_total", "reason", "Refused before start, per second"),
        rate_by("kvstorm:aborted_requests_total", "phase, reason", "Aborts per second by phase"),
    )


def slo_board(slos: Sequence[Slo]) -> Board:
    panels = []
    for slo in slos:
        if slo.kind == "events":
            panels += _events_panels(slo)
        else:
            panels.append(_guardrail_panel(slo))
    ttft = next(slo for slo in slos if slo.name == "ttft")
    overlay = Panel(
        "Preemptions against TTFT p99",
        (
            Query(
                f"histogram_quantile(0.99, sum by (le) "
                f"(rate(vllm:time_to_first_token_seconds_bucket{{{SEL}}}[{RATE}])))",
                "TTFT p99",
            ),
            Query(f"sum(rate(vllm:num_preemptions_total{{{SEL}}}[{RATE}]))", "preemptions/s"),
        ),
        unit="s",
        right_axis=("preemptions/s",),
        right_unit="ops",
        thresholds=((None, GREEN), (ttft.threshold, RED)),
        description="On one time axis: when preemptions rise, does the first token wait?",
    )
    return Board(
        uid="kvstorm-slo",
        title="kvstorm: SLOs",
        description="Each SLO of the spec: its SLI now, the error budget left, burn rates; guardrails",
        rows=(("SLOs", tuple(panels)), ("Preemption and latency", (overlay,))),
    )


def _events_panels(slo: Slo) -> list[Panel]:
    model = '{model_name=~"$model"}'
    budget = slo.error_budget
    sli = Panel(
        f"{slo.title}: good over 5 minutes",
        (Query(f"1 - max({slo.recorded_error_ratio('5m')}{model})", "SLI"),),
        kind="stat",
        unit="percentunit",
        description=slo.description,
        thresholds=((None, RED), (slo.objective, GREEN)),
    )
    remaining = Panel(
        f"{slo.title}: error budget left ({BUDGET_WINDOW})",
        (Query(f"1 - max({slo.error_ratio(BUDGET_WINDOW)}) / {budget:g}", "budget left"),),
        kind="stat",
        unit="percentunit",
        description=f"1 - (bad fraction over {BUDGET_WINDOW}) / {budget:.2%}",
        thresholds=((None, RED), (0.25, ORANGE), (0.5, GREEN)),
    )
    burn = Panel(
        f"{slo.title}: burn rate",
        tuple(
            Query(f"max({slo.recorded_error_ratio(window)}{model}) / {budget:g}", window)
            for window in ("5m", "1h", "6h")
        ),
        unit="short",
        description="1: the budget lasts exactly the window; 14.4 over 1h and 5m pages",
        thresholds=((None, GREEN), (6, ORANGE), (14.4, RED)),
    )
    return [sli, remaining, burn]


def _guardrail_panel(slo: Slo) -> Panel:
    return Panel(
        slo.title,
        (Query(f'max({guardrail_record(slo)}{{model_name=~"$model"}})', slo.name),),
        kind="stat",
        unit=slo.unit,
        description=slo.description,
        thresholds=((None, GREEN), (slo.threshold, RED)),
    )


def chaos_board() -> Board:
    fault_windows = Panel(
        "Fault windows (controller and engine)",
        (
            Query("max by (fault) (kvstorm_chaos_fault_active)", "{{fault}}"),
            Query(f"max by (fault) (kvstorm:active_faults{{{SEL}}})", "engine {{fault}}"),
        ),
        kind="state",
    )
    client = Panel(
        "The clients' view: requests per second by outcome",
        (Query(f"sum by (outcome) (rate(kvstorm_chaos_client_requests_total[{RATE}]))", "{{outcome}}"),),
        unit="ops",
        description="From the chaos controller's load generator: broken_stream is the failure the project is about",
    )
    server = rate_by(
        "vllm:request_success_total", "finished_reason", "The server's view: finished requests per second by reason"
    )
    ttft = Panel(
        "Time to first token p99: client and server",
        (
            Query(
                "histogram_quantile(0.99, sum by (le) "
                f"(rate(kvstorm_chaos_client_time_to_first_token_seconds_bucket[{RATE}])))",
                "client",
            ),
            Query(
                f"histogram_quantile(0.99, sum by (le) "
                f"(rate(vllm:time_to_first_token_seconds_bucket{{{SEL}}}[{RATE}])))",
                "server",
            ),
        ),
        unit="s",
        description="Same buckets on both sides: the gap is the network and the client",
    )
    phase = Panel("Experiment phase", (Query("max by (phase) (kvstorm_chaos_run_phase)", "{{phase}}"),), kind="state")
    in_flight = Panel(
        "Client requests in flight", (Query("sum(kvstorm_chaos_client_in_flight)", "in flight"),), unit="short"
    )
    return Board(
        uid="kvstorm-chaos",
        title="kvstorm: chaos",
        description="What the chaos harness did (fault windows, phases) beside what clients and server saw",
        rows=(("Faults", (fault_windows, phase)), ("Clients and server", (client, server, ttft, in_flight))),
    )
