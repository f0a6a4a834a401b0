"""The controller without --model asks its target which model it serves, at each run's start (the first of its
/v1/models: every other controller test runs so against the real engine); a target that names none refuses the run
with a 502 that says why, before anything starts."""

from __future__ import annotations

from types import SimpleNamespace

import requests

from chaos.injectors.engine_admin import ADMIN_TOKEN_ENV
from tests.chaos.test_controller import AUTH, controller
from tests.loadgen.test_served_model import answering


def test_a_target_that_names_no_model_refuses_the_run_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "an-admin-token")
    with answering(404, b"no such route") as url, controller(SimpleNamespace(url=url), tmp_path) as (controller_url, _):
        refused = requests.post(
            f"{controller_url}/runs", json={"experiment": "burst-with-vram-cap"}, headers=AUTH, timeout=60
        )
        assert refused.status_code == 502, refused.text
        assert "did not say which model it serves" in refused.json()["detail"]
        assert "HTTP 404" in refused.json()["detail"]
        assert requests.get(f"{controller_url}/runs", headers=AUTH, timeout=30).json() == []
