"""The generated dashboards against Grafana's own schema: grafana-foundation-sdk's Python types, generated from the
CUE kinds of the Grafana release the compose stack runs (pinned in pyproject.toml's dev extra).

The SDK's ``from_json`` neither rejects an unknown key (it drops it) nor checks a value's type (it stores whatever
it is given), so both checks are made here: a key of the input that the model's ``to_json`` does not give back, or
gives back changed, is a field the schema does not know; a value that does not match the model's type hints (an
enum member, a literal, a number, a list of models) is an invalid value. A panel's options, its custom field config
and its Prometheus queries are decoded with the panel plugin's and the datasource's own types."""

from __future__ import annotations

import enum
import json
import types
import typing
from pathlib import Path

import pytest
from grafana_foundation_sdk.cog import runtime, variants  # the dev extra has it
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import dashboard as schema

from dashboards.build import build_all
from dashboards.slo import PROFILES, load_spec

register_default_plugins()
# The panel plugins Grafana ships whose options the SDK types; a row is the dashboard's own.
PANEL_TYPES = frozenset(runtime.Runtime().panelcfg_variants) | {"row"}
# The schema types a datasource as a reference ({"type", "uid"}); the dashboards give the datasource variable as a
# string, the older form Grafana still resolves (a name, a uid or a variable), and test_spec_and_files pins it. The
# check reads that one string as the reference it stands for, which also types the panels' queries as Prometheus'.
DATASOURCE_VARIABLE = "${datasource}"
DATASOURCE_REF = {"type": "prometheus", "uid": DATASOURCE_VARIABLE}
# A Prometheus annotation's settings that Grafana's Prometheus datasource reads from the annotation itself, beside
# the fields the schema types (its AnnotationQuery is the part every datasource shares): checked here by type.
PROMETHEUS_ANNOTATION_FIELDS = {"step": str, "titleFormat": str, "useValueForTime": bool}


@pytest.fixture(scope="module", params=sorted(PROFILES))
def dashboards(request, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp(request.param)
    build_all(out, load_spec(request.param))
    return {path.name: json.loads(path.read_text()) for path in sorted((out / "grafana" / "dashboards").glob("*.json"))}


def schema_problems(raw: dict) -> list[str]:
    """Every unknown field and invalid value of a dashboard's JSON, as ``path: what``; empty when it is valid."""
    raw = _with_datasource_refs(raw)
    problems = _prometheus_annotation_problems(raw)
    try:
        model = schema.Dashboard.from_json(raw)
    except (AttributeError, KeyError, TypeError) as error:
        return [*problems, f"dashboard: the schema's decoder fails on it: {error!r}"]
    problems += _type_problems(model, "dashboard")
    _diff(raw, json.loads(json.dumps(model, cls=JSONEncoder)), "dashboard", problems)
    for index, panel in enumerate(raw.get("panels", [])):
        if panel.get("type") not in PANEL_TYPES:
            problems.append(f"dashboard.panels[{index}].type: {panel.get('type')!r} is no panel Grafana ships")
    return problems


def _prometheus_annotation_problems(raw: dict) -> list[str]:
    """Checks and takes out of ``raw`` the Prometheus settings of its annotations (PROMETHEUS_ANNOTATION_FIELDS)."""
    problems = []
    for index, annotation in enumerate(raw.get("annotations", {}).get("list", [])):
        if annotation.get("datasource") != DATASOURCE_REF:
            continue
        for key, kind in PROMETHEUS_ANNOTATION_FIELDS.items():
            if key in annotation and not isinstance(annotation.pop(key), kind):
                problems.append(f"dashboard.annotations.list[{index}].{key}: is no {kind.__name__}")
    return problems


def _with_datasource_refs(value: object) -> object:
    """``value`` with every datasource given as the variable turned into the reference the schema types."""
    if isinstance(value, dict):
        return {
            key: DATASOURCE_REF if key == "datasource" and item == DATASOURCE_VARIABLE else _with_datasource_refs(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_with_datasource_refs(item) for item in value]
    return value


def _diff(raw: object, kept: object, path: str, problems: list[str]) -> None:
    """What of ``raw`` the model did not give back as it was (``kept`` may add defaults: those are fine)."""
    if isinstance(raw, dict) and isinstance(kept, dict):
        for key, value in raw.items():
            if key not in kept:
                what = "null, which the schema has no type for" if value is None else "unknown field"
                problems.append(f"{path}.{key}: {what}")
            else:
                _diff(value, kept[key], f"{path}.{key}", problems)
    elif isinstance(raw, list) and isinstance(kept, list) and len(raw) == len(kept):
        for index, (item, kept_item) in enumerate(zip(raw, kept, strict=True)):
            _diff(item, kept_item, f"{path}[{index}]", problems)
    elif isinstance(raw, list) and isinstance(kept, list):
        problems.append(f"{path}: {len(raw)} items read back as {len(kept)}")
    elif raw != kept:
        problems.append(f"{path}: {raw!r} read back as {kept!r}")


def _type_problems(model: object, path: str) -> list[str]:
    problems = []
    for name, hint in typing.get_type_hints(type(model)).items():
        value = getattr(model, name, None)
        problems += _value_problems(value, hint, f"{path}.{_json_name(name)}")
    return problems


def _json_name(attribute: str) -> str:
    """The JSON key of one of the SDK's attributes (``grid_pos`` is ``gridPos``, ``type_val`` is ``type``)."""
    head, *rest = attribute.removesuffix("_val").split("_")
    return head + "".join(word.capitalize() for word in rest)


def _value_problems(value: object, hint: object, path: str) -> list[str]:
    """``value`` against a type hint of the SDK; recurses into the models it holds."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (typing.Any, object):  # a panel's options and custom field config: the plugin's model, if it has one
        return _type_problems(value, path) if hasattr(type(value), "from_json") else []
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return []
        arms = [arm for arm in args if arm is not type(None)]
        models = [arm for arm in arms if isinstance(arm, type) and hasattr(arm, "from_json") and isinstance(value, arm)]
        results = [_value_problems(value, arm, path) for arm in models or arms]
        return [] if any(not result for result in results) else min(results, key=len)
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} is none of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r} is no list"]
        return [
            problem
            for index, item in enumerate(value)
            for problem in _value_problems(item, args[0], f"{path}[{index}]")
        ]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is no object"]
        return [problem for key, item in value.items() for problem in _value_problems(item, args[1], f"{path}.{key}")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [member.value for member in hint]
        return [] if value in allowed else [f"{path}: {value!r} is none of {allowed}"]
    if hint is bool:
        return [] if isinstance(value, bool) else [f"{path}: {value!r} is no boolean"]
    if hint in (int, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and (hint is float or value == int(value))
        return [] if ok else [f"{path}: {value!r} is no {hint.__name__}"]
    if hint is str:
        return [] if isinstance(value, str) else [f"{path}: {value!r} is no string"]
    if hint is variants.Dataquery:
        if isinstance(value, runtime.UnknownDataquery):
            return [f"{path}: a query of no datasource the schema knows"]
        return _type_problems(value, path)
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        return _type_problems(value, path) if isinstance(value, hint) else [f"{path}: {value!r} is no {hint.__name__}"]
    return []


def test_every_dashboard_is_valid_for_grafanas_schema(dashboards):
    for name, raw in dashboards.items():
        problems = schema_problems(raw)
        assert not problems, f"{name}: {len(problems)} problems:\n" + "\n".join(problems)


def test_every_panel_type_is_one_grafana_ships(dashboards):
    types_used = {panel["type"] for raw in dashboards.values() for panel in raw["panels"]}
    assert types_used <= PANEL_TYPES, types_used - PANEL_TYPES


def test_the_check_finds_an_unknown_field_a_wrong_type_and_an_unknown_panel(dashboards):
    raw = json.loads(json.dumps(next(iter(dashboards.values()))))
    panel = next(panel for panel in raw["panels"] if panel["type"] == "timeseries")
    panel["colour"] = "red"
    panel["gridPos"]["h"] = "8"
    panel["fieldConfig"]["defaults"]["custom"]["lineWidht"] = 2
    panel["options"]["legend"]["displayMode"] = "tabular"
    panel["targets"][0]["intervalFactr"] = 2
    raw["templating"]["list"][0]["hide"] = 7
    raw["panels"].append({**panel, "type": "graph-legacy", "id": 999})
    problems = "\n".join(schema_problems(raw))
    for expected in (
        ".colour: unknown field",
        ".gridPos.h: '8' is no int",
        ".fieldConfig.defaults.custom.lineWidht: unknown field",
        ".options.legend.displayMode: 'tabular' is none of",
        ".targets[0].intervalFactr: unknown field",
        "templating.list[0].hide: 7 is none of",
        ".type: 'graph-legacy' is no panel Grafana ships",
    ):
        assert expected in problems, f"{expected!r} not found in:\n{problems}"


def test_the_committed_dashboards_are_checked_too():
    committed = Path(__file__).resolve().parents[2] / "dashboards" / "generated" / "grafana" / "dashboards"
    for path in sorted(committed.glob("*.json")):
        problems = schema_problems(json.loads(path.read_text()))
        assert not problems, f"{path.name}:\n" + "\n".join(problems)
