"""``kvstorm simulate``: the engine's own scheduler in virtual time (``engine.core.simulator``), driven by the load
generator's plans and a step-cost profile, written out as the same results file and report as a real run."""
