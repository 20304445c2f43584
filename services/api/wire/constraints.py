"""Structured-output parameters of every wire format, parsed into the one ``Constraint``.

* OpenAI (Chat ``response_format``, Responses ``text.format``): ``{type: "text"}`` (none),
  ``{type: "json_object"}``, and ``{type: "json_schema", ...}`` with the schema nested under
  ``json_schema`` (Chat) or flat beside ``type`` (Responses).
* vLLM's ``structured_outputs`` (and its older top-level ``guided_*`` spellings): ``json``
  (a schema, as an object or a JSON string), ``regex``, ``choice``, ``grammar`` (Lark, in
  llguidance's dialect) and ``json_object``.
* Anthropic ``output_config.format`` (and the beta ``output_format``):
  ``{type: "json_schema", schema}``.

Each is compiled-checked here (``shared.grammar.check_constraint``), so what cannot compile is a
400 naming the parameter before anything is enqueued. ``check_tool_schemas`` does the same for
the argument schemas a forced choice or ``strict`` puts under constraint.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from shared.errors import InvalidRequest
from shared.grammar import check_constraint, check_schema
from shared.jobs import Constraint, JsonObject, ToolChoice, ToolDef

__all__ = [
    "anthropic_format",
    "chat_constraint",
    "check_tool_schemas",
    "openai_format",
    "vllm_structured_outputs",
]

_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _schema(raw: object, param: str) -> JsonObject:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequest(f"the schema is not valid JSON: {exc}", param=param) from exc
    if not isinstance(raw, dict):
        raise InvalidRequest("the schema must be a JSON object", param=param)
    return raw


def _checked(constraint: Constraint, param: str) -> Constraint:
    check_constraint(constraint, param)
    return constraint


def openai_format(raw: object, param: str, *, nested: bool) -> Constraint | None:
    """Chat's ``response_format`` (``nested``: schema under ``json_schema``) or ``text.format``.

    Raises:
        InvalidRequest: an unknown type, a missing or uncompilable schema.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(Constraint(kind="json_object"), param)
    if kind != "json_schema":
        raise InvalidRequest(
            f"{param} type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
            param=f"{param}.type",
        )
    spec = raw.get("json_schema") if nested else raw
    where = f"{param}.json_schema" if nested else param
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise InvalidRequest(f"{where}.schema is required", param=f"{where}.schema")
    name = spec.get("name")
    constraint = Constraint(
        kind="json_schema",
        json_schema=_schema(spec["schema"], f"{where}.schema"),
        name=name if isinstance(name, str) else None,
    )
    return _checked(constraint, f"{where}.schema")


def vllm_structured_outputs(
    raw: object, param: str = "structured_outputs", spell: Callable[[str], str] | None = None
) -> Constraint | None:
    """vLLM's ``structured_outputs`` object: exactly one of json/regex/choice/grammar.

    ``spell(key)`` names a key's parameter (default ``structured_outputs.<key>``; vLLM's older
    top-level ``guided_<key>`` fields come through here too).

    Raises:
        InvalidRequest: none or several set, a wrong type, or a payload that does not compile.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    given = [k for k in _VLLM_KEYS if raw.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(f"{param} needs exactly one of {', '.join(_VLLM_KEYS)}", param=param)
    key = given[0]
    value = raw[key]
    where = spell(key) if spell is not None else f"{param}.{key}"
    if key == "json":
        constraint = Constraint(kind="json_schema", json_schema=_schema(value, where))
    elif key == "json_object":
        constraint = Constraint(kind="json_object")
    elif key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{where} must be a list of strings", param=where)
        constraint = Constraint(kind="choice", choices=list(value))
    elif not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string", param=where)
    elif key == "regex":
        constraint = Constraint(kind="regex", regex=value)
    else:
        constraint = Constraint(kind="grammar", grammar=value)
    return _checked(constraint, where)


def chat_constraint(
    response_format: object, structured_outputs: object, guided: dict[str, object]
) -> Constraint | None:
    """Chat's one constraint: ``response_format``, ``structured_outputs`` or ``guided_*``.

    Raises:
        InvalidRequest: more than one is set, or the one set is invalid.
    """
    given = {k: v for k, v in guided.items() if v is not None}
    found = [
        c
        for c in (
            openai_format(response_format, "response_format", nested=True),
            vllm_structured_outputs(structured_outputs),
            vllm_structured_outputs(given or None, "guided_json", lambda k: f"guided_{k}"),
        )
        if c is not None
    ]
    if len(found) > 1:
        raise InvalidRequest(
            "set one of response_format, structured_outputs and guided_*, not several",
            param="structured_outputs",
        )
    return found[0] if found else None


def anthropic_format(raw: object, param: str) -> Constraint | None:
    """Anthropic's ``{type: "json_schema", schema}`` output format.

    Raises:
        InvalidRequest: another type, or a missing or uncompilable schema.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "json_schema":
        raise InvalidRequest(f"{param}.type must be 'json_schema'", param=f"{param}.type")
    if raw.get("schema") is None:
        raise InvalidRequest(f"{param}.schema is required", param=f"{param}.schema")
    constraint = Constraint(kind="json_schema", json_schema=_schema(raw["schema"], param))
    return _checked(constraint, f"{param}.schema")


def check_tool_schemas(
    tools: list[ToolDef], choice: ToolChoice, param: Callable[[int], str]
) -> None:
    """Reject argument schemas that would be constrained and cannot compile.

    Under a forced choice every offered tool's arguments follow its schema; otherwise only
    ``strict`` tools' do. ``param(i)`` names tool ``i``'s schema in the wire format.
    """
    forced = choice.mode in ("required", "named")
    for i, tool in enumerate(tools):
        offered = choice.mode != "named" or tool.name == choice.name
        if (forced and offered) or tool.strict:
            check_schema(tool.parameters, param(i))
