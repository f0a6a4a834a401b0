"""schemathesis drives the live server from its OpenAPI document: no 5xx, every response as documented.

The schema is built at import from the same function that serves /openapi.json (schemathesis'
fixture-based lazy loader does not run under pytest 9), and a test checks the server serves exactly
that document. Generation is bounded (max_examples) and the model's context is tiny, so a generated
request generates at most a few dozen tokens.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from engine.serving.async_engine import AsyncEngine
from engine.serving.metrics import EngineMetrics
from engine.serving.protocol import openapi_document
from engine.serving.server import ServerConfig, create_app
from tests.engine.serving.conftest import make_engine, make_tiny_engine, running_server

MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    engine = make_engine(real_model, real_tokenizer, num_blocks=64, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, admin_token=None, strict_api=True) as running:
        yield running


DOCUMENT = openapi_document(include_admin=False)
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_the_server_serves_the_document_under_test(server):
    assert requests.get(f"{server.url}/openapi.json").json() == DOCUMENT


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_response_is_documented_and_none_is_a_server_error(server, case):
    # Schema-valid input may still be refused with a documented 400 (e.g. prompt + max_tokens over the context):
    # the schema cannot know how many tokens a string is, so "valid data is accepted" cannot hold here.
    case.call_and_validate(base_url=server.url, excluded_checks=[positive_data_acceptance])


def test_the_document_describes_the_validated_request_fields(server):
    document = requests.get(f"{server.url}/openapi.json").json()
    completion = document["components"]["schemas"]["CompletionRequest"]
    assert completion["additionalProperties"] is False
    assert set(completion["required"]) == {"model", "prompt"}
    assert completion["properties"]["max_tokens"]["anyOf"][0] == {"minimum": 1, "type": "integer"}


@pytest.mark.parametrize("admin_token", [None, "s3cret-admin-token"])
def test_the_router_and_the_document_list_the_same_routes(admin_token):
    """Both are built from one route table: a route the server answers is documented, and a documented one exists
    (the admin routes only with a token)."""
    engine = make_tiny_engine()
    app = create_app(
        AsyncEngine(engine, EngineMetrics("m")), ServerConfig(served_model_name="m", admin_token=admin_token)
    )
    routed = {
        (route.method.lower(), route.resource.canonical) for route in app.router.routes() if route.method != "HEAD"
    }
    document = openapi_document(include_admin=admin_token is not None)
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert routed == documented
    assert (("post", "/admin/faults") in routed) == (admin_token is not None)
