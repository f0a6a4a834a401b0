"""The model a server serves, asked of the server: what the harness sends when the operator names none.

A stack pointed at a server by its URL alone (compose's ``KVSTORM_TARGET_URL``) learns the model name from it: the
first ``id`` of its ``GET /v1/models`` (OpenAI's model list, which vLLM, SGLang, TGI and kvstorm answer). The answer
is input like any other: read up to :data:`MAX_BODY_BYTES`, typed where it is read, and an ``id`` is taken only as a
short printable string.
"""

from __future__ import annotations

import json

import requests

MAX_BODY_BYTES = 1 << 20
MAX_MODEL_CHARS = 256


class NoServedModel(RuntimeError):
    """The server did not say which model it serves; the message says why."""


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model of ``base_url``'s ``/v1/models``; :class:`NoServedModel` when there is none to take."""
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        with requests.get(url, timeout=timeout_s, stream=True) as response:
            body = response.raw.read(MAX_BODY_BYTES + 1, decode_content=True)
    except requests.RequestException as error:
        raise NoServedModel(f"GET {url}: {type(error).__name__}") from None
    if response.status_code != 200:
        raise NoServedModel(f"GET {url}: HTTP {response.status_code}")
    if len(body) > MAX_BODY_BYTES:
        raise NoServedModel(f"GET {url}: an answer of more than {MAX_BODY_BYTES} bytes")
    try:
        entries = json.loads(body)["data"]
    except (ValueError, KeyError, TypeError):
        raise NoServedModel(f"GET {url}: not OpenAI's model list") from None
    ids = (entry.get("id") for entry in entries if isinstance(entry, dict)) if isinstance(entries, list) else ()
    for model in ids:
        if isinstance(model, str) and 0 < len(model) <= MAX_MODEL_CHARS and model.isprintable():
            return model
    raise NoServedModel(f"GET {url}: no model listed")
