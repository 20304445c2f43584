"""Constraints as llguidance grammars: what a job's answer must match, built in one place.

The API calls ``check_constraint`` / ``check_schema`` while parsing a body, so a schema the
library cannot compile, an unsupported keyword, a regex that does not parse or an empty choice
list is a 400 naming the parameter before anything is enqueued. The worker calls ``job_grammar``
and compiles what it returns; both sides build the grammar the same way, so what the API
accepted is what the worker runs.

Forced tool calls (``tool_choice`` required / named) become a grammar in the model's own
tool-call syntax (``ToolMarkers``): Hermes ``<tool_call>`` tokens, Mistral ``[TOOL_CALLS]`` and a
JSON list, or a bare Llama 3 JSON object; the arguments follow each tool's JSON schema. A model
that declares no syntax gets the bare JSON object under a forced choice, which the worker's
tool-call parser reads as a call (``tool_markers``). ``strict`` tools under ``auto`` on a model
with a call marker token get free text or calls whose arguments follow their schema.

llguidance is imported on first use: importing ``shared`` does no I/O (its import reads its
package metadata).

JSON is generated compact with single spaces (``{"a": 1, "b": [2, 3]}``): no free whitespace,
so a small model cannot wander into endless newlines inside an object.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Literal

from shared.errors import InvalidRequest
from shared.jobs import Constraint, GenerateRequest, JsonObject, ToolDef
from shared.model_card import ModelCard, ToolMarkers

if TYPE_CHECKING:
    from llguidance import LLMatcher

__all__ = [
    "JSON_OPTIONS",
    "check_constraint",
    "check_schema",
    "constraint_grammar",
    "custom_format_constraint",
    "forces_tool_call",
    "job_grammar",
    "tool_call_grammar",
    "tool_markers",
]

JSON_OPTIONS: dict[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_ANY_OBJECT: JsonObject = {"type": "object"}
_TEXT = r"TEXT: /(.|\n)*/"  # free text: special tokens (markers) never match it


def _matcher() -> type[LLMatcher]:
    from llguidance import LLMatcher  # here, not at import: see the module docstring

    return LLMatcher


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escaping is Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _schema_grammar(schema: JsonObject) -> str:
    try:
        return _matcher().grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}") from exc


def constraint_grammar(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (not yet validated).

    Raises:
        InvalidRequest: the payload ``kind`` names is missing or not JSON-serializable.
    """
    kind = constraint.kind
    if kind == "json_object":
        return _schema_grammar(_ANY_OBJECT)
    if kind == "json_schema" and constraint.json_schema is not None:
        return _schema_grammar(constraint.json_schema)
    if kind == "regex" and constraint.regex is not None:
        return _matcher().grammar_from_regex(constraint.regex)
    if kind == "choice" and constraint.choices:
        return _matcher().grammar_from_lark(
            "start: " + " | ".join(_lit(c) for c in constraint.choices)
        )
    if kind == "grammar" and constraint.grammar is not None:
        return _matcher().grammar_from_lark(constraint.grammar)
    raise InvalidRequest(f"a {kind} constraint needs its {kind.replace('_', ' ')}")


@functools.lru_cache(maxsize=256)
def _grammar_error(grammar: str) -> str | None:
    """llguidance's first error for ``grammar``, or None. Cached (~0.2 ms a check): clients send
    the same schema with every request, and one Responses request checks its format more than
    once (parsing, the echoed ``text``, the job)."""
    is_error, messages = _matcher().validate_grammar_with_warnings(grammar)
    return str(messages[0]).strip() if is_error else None


def _validate(grammar: str, param: str, what: str) -> None:
    error = _grammar_error(grammar)
    if error is not None:
        raise InvalidRequest(f"{param}: {what}: {error}", param=param)


def check_constraint(constraint: Constraint, param: str) -> None:
    """Reject a constraint llguidance cannot compile, naming ``param``.

    Raises:
        InvalidRequest: empty choices, an invalid schema/regex/grammar or an unsupported keyword.
    """
    if constraint.kind == "choice" and not constraint.choices:
        raise InvalidRequest(f"{param}: choice must list at least one option", param=param)
    try:
        grammar = constraint_grammar(constraint)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{param}: {exc.message}", param=param) from exc
    what = {"json_schema": "invalid JSON schema", "regex": "invalid regex"}
    _validate(grammar, param, what.get(constraint.kind, f"invalid {constraint.kind}"))


def check_schema(schema: JsonObject, param: str) -> None:
    """Reject a tool's argument schema llguidance cannot compile, naming ``param``."""
    check_constraint(Constraint(kind="json_schema", json_schema=schema or _ANY_OBJECT), param)


def custom_format_constraint(
    syntax: Literal["lark", "regex"], definition: str, param: str = "format"
) -> Constraint:
    """The constraint of a grammar given as a ``lark`` or ``regex`` definition.

    For tools whose input is free text in a grammar (OpenAI ``custom`` tools'
    ``format: {type: "grammar", syntax, definition}``): the result goes into
    ``GenerateRequest.constraint`` like any other.

    Raises:
        InvalidRequest: the definition does not compile (naming ``param``).
    """
    if syntax == "regex":
        constraint = Constraint(kind="regex", regex=definition)
    else:
        constraint = Constraint(kind="grammar", grammar=definition)
    check_constraint(constraint, param)
    return constraint


def forces_tool_call(job: GenerateRequest) -> bool:
    """``tool_choice`` required or named, with tools declared."""
    return bool(job.tools) and job.tool_choice.mode in ("required", "named")


def tool_markers(declared: ToolMarkers | None, job: GenerateRequest) -> ToolMarkers | None:
    """The tool-call syntax the job's answer is parsed (and forced) in.

    The model's own (``declared``) when it has one; under a forced choice a model without one
    writes the bare JSON object convention, since the grammar writes the call for it.
    """
    if declared is not None or not forces_tool_call(job):
        return declared
    return ToolMarkers(style="llama3_json")


def _call_rules(tools: list[ToolDef], style: str, *, schemas: bool) -> list[str]:
    key = "parameters" if style == "llama3_json" else "arguments"
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + f', "{key}": '
        use = schemas or tool.strict
        schema = (tool.parameters or _ANY_OBJECT) if use else _ANY_OBJECT
        rules.append(f"call_{i}: {_lit(head)} args_{i} {_lit('}')}")
        rules.append(f"args_{i}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
    return rules


def tool_call_grammar(job: GenerateRequest, markers: ToolMarkers, *, forced: bool) -> str | None:
    """A Lark grammar for the job's tool calls in ``markers``' syntax.

    ``forced``: the answer is one call (several when ``parallel_tool_calls``) to the named tool
    or any declared one, arguments per schema. Otherwise free text, then optionally calls after
    the model's call marker, strict tools' arguments per schema; None where the syntax has no
    marker token to tell text from a call (Llama 3 JSON).
    """
    tools = job.tools
    if job.tool_choice.mode == "named":
        tools = [t for t in tools if t.name == job.tool_choice.name]
    several = job.parallel_tool_calls and job.tool_choice.mode != "named"
    rules = _call_rules(tools, markers.style, schemas=forced)
    if markers.style == "hermes" and markers.open_id is not None:
        block = f"<[{markers.open_id}]> {_lit(chr(10))} call {_lit(chr(10))} <[{markers.close_id}]>"
        calls = f"block ({_lit(chr(10))} block)*" if several else "block"
        rules.append(f"block: {block}")
    elif markers.style == "mistral" and markers.open_id is not None:
        more = f" ({_lit(', ')} call)*" if several else ""
        calls = f"<[{markers.open_id}]> {_lit('[')} call{more} {_lit(']')}"
    elif forced:
        calls = f"call ({_lit('; ')} call)*" if several else "call"
    else:
        return None
    start = f"start: {calls}" if forced else f"start: TEXT | TEXT calls\ncalls: {calls}\n{_TEXT}"
    return "\n".join([start, *rules]) + "\n"


def job_grammar(job: GenerateRequest, card: ModelCard) -> str | None:
    """The grammar the worker constrains the job's answer with, or None when it is free.

    A forced tool choice wins over ``constraint`` (the answer is the call); ``strict`` tools
    under ``auto`` are constrained only when no ``constraint`` is set.
    """
    markers = tool_markers(card.tools, job)
    if forces_tool_call(job) and markers is not None:
        return tool_call_grammar(job, markers, forced=True)
    if job.constraint is not None:
        return constraint_grammar(job.constraint)
    strict = any(t.strict for t in job.tools) and job.tool_choice.mode == "auto"
    if strict and markers is not None:
        return tool_call_grammar(job, markers, forced=False)
    return None
