"""A request's JSON body, validated; unknown fields dropped and named (``IGNORED_FIELDS_HEADER``), within bounds.

More or longer unknown fields than the caps are a 400, as is one whose name could not go back in a header (only
RFC 7230 token characters do: a CR or LF would split the response's head); the set of names already logged (so
each is logged once) stops growing at its cap.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

from aiohttp import web
from pydantic import BaseModel, ValidationError

from engine.serving.protocol import ApiError, api_error_from_validation

logger = logging.getLogger(__name__)
IGNORED_FIELDS_HEADER = "X-Kvstorm-Ignored-Fields"
MAX_UNKNOWN_FIELDS = 32
MAX_UNKNOWN_FIELD_CHARS = 64
MAX_LOGGED_FIELD_NAMES = 256
HEADER_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_ignored_fields_logged: set[str] = set()


async def read_body(request: web.Request, model: type[BaseModel], strict: bool) -> tuple[BaseModel, list[str]]:
    """The validated body, and the names of the unknown fields dropped from it (none when ``strict``: a 400)."""
    raw = await request.read()  # 413 (HTTPRequestEntityTooLarge) above client_max_size
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"request body is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    if SURROGATE_ESCAPE.search(text):  # rare (an emoji escaped as a pair): only then a second look at the strings
        _check_no_lone_surrogate(data)
    ignored: list[str] = []
    while True:
        try:
            return model.model_validate(data), ignored
        except ValidationError as error:
            unknown = [e["loc"] for e in error.errors() if e["type"] == "extra_forbidden"]
            if strict or not unknown:
                raise api_error_from_validation(error) from None
            _check_unknown_fields(unknown, len(ignored))
            try:
                ignored.extend(_drop(data, loc) for loc in unknown)
            except (KeyError, IndexError, TypeError):  # a location inside a union's branch: refuse rather than guess
                raise api_error_from_validation(error) from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply") from None


def _check_no_lone_surrogate(data: dict) -> None:
    """A JSON escape can write half of a surrogate pair (``\\ud800``): a string no UTF-8 holds, which neither the
    tokenizer nor a JSON answer could take."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "request body is not valid Unicode: a \\u escape writes half of a surrogate pair") from None


def ignored_header(ignored: Sequence[str]) -> dict[str, str]:
    return {IGNORED_FIELDS_HEADER: ",".join(dict.fromkeys(ignored))} if ignored else {}


def _check_unknown_fields(unknown: Sequence[tuple], num_dropped: int) -> None:
    if num_dropped + len(unknown) > MAX_UNKNOWN_FIELDS:
        raise ApiError(400, f"more than {MAX_UNKNOWN_FIELDS} unknown fields; see GET /openapi.json for the known ones")
    for loc in unknown:
        name = str(loc[-1])
        if len(name) > MAX_UNKNOWN_FIELD_CHARS:
            raise ApiError(
                400,
                f"unknown field {name[:MAX_UNKNOWN_FIELD_CHARS]!r}... (name over {MAX_UNKNOWN_FIELD_CHARS} characters)",
            )
        if not HEADER_TOKEN.fullmatch(_dotted(loc)):
            raise ApiError(
                400,
                f"unknown field {name!r}: only a name of letters, digits and !#$%&'*+-.^_`|~ can be ignored (and named "
                f"in {IGNORED_FIELDS_HEADER}); see GET /openapi.json for the known fields",
            )


def _dotted(loc: tuple) -> str:
    """A field's name as the header gives it: its path, list indexes left out."""
    return ".".join(str(part) for part in loc if not isinstance(part, int))


def _drop(data: dict, loc: tuple) -> str:
    """Remove the field at ``loc`` and say its name (logged the first time it is seen)."""
    holder = data
    for part in loc[:-1]:
        holder = holder[part]
    del holder[loc[-1]]
    name = _dotted(loc)
    if name not in _ignored_fields_logged and len(_ignored_fields_logged) < MAX_LOGGED_FIELD_NAMES:
        _ignored_fields_logged.add(name)
        logger.warning("ignoring the unknown request field %r (--strict-api refuses it)", name)
    return name
