"""Responses tools: every tool type the API defines, mapped onto what the model can call.

Owns the translation in both directions. Requests declare ``function``, ``custom`` (freeform),
``namespace`` (a group of function/custom tools), client-executed ``tool_search`` and hosted
tools (web search, file search, code interpreter, image generation, computer use, MCP, shell).
The model only ever sees JSON-schema functions (``ToolDef``), so:

- a namespaced tool is offered as ``<namespace>.<name>``, the recipient form the Responses
  models use for namespaced tools, and its calls come back as ``function_call`` (or
  ``custom_tool_call``) items with ``name`` and ``namespace`` apart, as Codex parses them;
- a ``custom`` tool is offered as a function of one string argument, ``input``; its calls come
  back as ``custom_tool_call`` items carrying that text as ``input``. The tool's ``format``
  (a lark or regex grammar) rides on ``ToolDef.input_format`` for constrained decoding;
- client ``tool_search`` is a function with the tool's own ``parameters``; its calls come back
  as ``tool_search_call`` items with the arguments as an object;
- hosted tools cannot run here: they are accepted, echoed, not offered to the model, and listed
  in the ``x-sluice-ignored-tools`` response header. ``tool_choice`` forcing one is a 400.

``routes`` recomputes the name mapping from the echoed ``tools`` of a stored response, so a
replay or a GET renders the same items as the live stream. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal, TypeVar

import msgspec

from services.api.wire.common import IGNORED_TOOLS_HEADER, JsonObject
from shared.errors import InvalidRequest
from shared.jobs import ToolDef

__all__ = [
    "CUSTOM_INPUT",
    "HOSTED_TOOL_TYPES",
    "IGNORED_TOOLS_HEADER",
    "Route",
    "ToolSet",
    "call_arguments",
    "custom_input",
    "exposed_name",
    "parse_tools",
    "routes",
]

CUSTOM_INPUT = "input"  # the one argument a freeform tool is offered with

# Tools OpenAI runs on its side; sluice has nothing to run them with.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
    }
)


class Route(msgspec.Struct, frozen=True, kw_only=True):
    """How a model-visible tool name maps back onto the wire."""

    kind: Literal["function", "custom", "tool_search"]
    name: str  # the name in the output item
    namespace: str | None = None


class ToolSet(msgspec.Struct, frozen=True, kw_only=True):
    """A request's tools: what the model sees, how calls map back, and what was ignored."""

    defs: list[ToolDef]
    routes: dict[str, Route]
    ignored: list[str]


class _Function(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class _Custom(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    format: JsonObject | None = None


class _ToolSearch(msgspec.Struct, kw_only=True):
    description: str | None = None
    execution: Literal["server", "client"] | None = None
    parameters: JsonObject | None = None


_CUSTOM_SCHEMA_NOTE = "The tool's whole input, as free text (not JSON)."
_TOOL_SEARCH_DEFAULT: JsonObject = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "What to search tools for."}},
    "required": ["query"],
}


def exposed_name(name: str, namespace: str | None) -> str:
    """The name the model calls a tool by.

    Args:
        name: the tool's own name.
        namespace: its namespace, if declared inside one.

    Returns:
        ``namespace.name`` for a namespaced tool, else ``name``.
    """
    return f"{namespace}.{name}" if namespace else name


def _custom_def(tool: _Custom, exposed: str) -> ToolDef:
    parameters: JsonObject = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": _CUSTOM_SCHEMA_NOTE}},
        "required": [CUSTOM_INPUT],
    }
    return ToolDef(
        name=exposed, description=tool.description, parameters=parameters, input_format=tool.format
    )


T = TypeVar("T")


def _convert(raw: JsonObject, cls: type[T], where: str) -> T:
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{exc} (at '{where}')", param=where) from exc


class _Builder:
    def __init__(self) -> None:
        self.defs: list[ToolDef] = []
        self.routes: dict[str, Route] = {}
        self.ignored: list[str] = []

    def add(self, raw: JsonObject, where: str, namespace: str | None = None) -> None:
        kind = raw.get("type")
        if kind == "function":
            fn = _convert(raw, _Function, where)
            name = exposed_name(fn.name, namespace)
            self.defs.append(
                ToolDef(
                    name=name,
                    description=fn.description,
                    parameters=fn.parameters or {},
                    # The Responses API's default is strict (Chat's is not): arguments are
                    # constrained to the schema unless the client says false.
                    strict=fn.strict is not False,
                )
            )
            self.routes[name] = Route(kind="function", name=fn.name, namespace=namespace)
        elif kind == "custom":
            custom = _convert(raw, _Custom, where)
            name = exposed_name(custom.name, namespace)
            self.defs.append(_custom_def(custom, name))
            self.routes[name] = Route(kind="custom", name=custom.name, namespace=namespace)
        elif kind == "namespace" and namespace is None:
            ns = raw.get("name")
            inner = raw.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise InvalidRequest(
                    "a namespace tool needs a 'name' and a list of 'tools'", param=where
                )
            for j, tool in enumerate(inner):
                if not isinstance(tool, dict) or tool.get("type") not in ("function", "custom"):
                    raise InvalidRequest(
                        "a namespace holds function and custom tools only",
                        param=f"{where}.tools[{j}].type",
                    )
                self.add(tool, f"{where}.tools[{j}]", ns)
        elif kind == "tool_search" and namespace is None:
            search = _convert(raw, _ToolSearch, where)
            if search.execution != "client":
                self.ignored.append("tool_search")  # hosted search: OpenAI's index, not ours
                return
            self.defs.append(
                ToolDef(
                    name="tool_search",
                    description=search.description,
                    parameters=search.parameters or _TOOL_SEARCH_DEFAULT,
                )
            )
            self.routes["tool_search"] = Route(kind="tool_search", name="tool_search")
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES and namespace is None:
            self.ignored.append(kind)
        else:
            raise InvalidRequest(f"Unsupported tool type {kind!r}", param=f"{where}.type")


def echoed(tools: Sequence[JsonObject]) -> list[JsonObject]:
    """The tools as the Response object echoes them: each function tool (a namespace's too)
    with its ``strict`` spelled out, ``true`` where the request left it out or null, as the
    API echoes its default."""
    out: list[JsonObject] = []
    for tool in tools:
        if tool.get("type") == "function" and tool.get("strict") is None:
            tool = {**tool, "strict": True}
        elif tool.get("type") == "namespace" and isinstance(inner := tool.get("tools"), list):
            tool = {**tool, "tools": echoed([t for t in inner if isinstance(t, dict)])}
        out.append(tool)
    return out


def parse_tools(raw: Sequence[JsonObject], param: str = "tools") -> ToolSet:
    """Parse a request's ``tools``.

    Args:
        raw: the tools as sent.
        param: where they sit in the request, for errors.

    Returns:
        The model's tools, the route of each, and the hosted tool types left out.

    Raises:
        InvalidRequest: a malformed tool or a type the API does not define.
    """
    builder = _Builder()
    for i, tool in enumerate(raw):
        builder.add(tool, f"{param}[{i}]")
    return ToolSet(defs=builder.defs, routes=builder.routes, ignored=builder.ignored)


def routes(raw: Sequence[JsonObject]) -> dict[str, Route]:
    """The routes of echoed tools (a stored response's ``tools``), never raising.

    Args:
        raw: the echoed tools.

    Returns:
        Model-visible name → route; tools that no longer parse are simply not routed.
    """
    try:
        return parse_tools(raw).routes
    except InvalidRequest:
        return {}


def custom_input(arguments: str) -> str:
    """The free text of a freeform call, out of the JSON arguments the model produced.

    Args:
        arguments: the call's arguments (``{"input": "..."}`` when the model followed the
            offered schema).

    Returns:
        The ``input`` string, or the arguments themselves when they are not that shape.
    """
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_INPUT), str):
        return str(parsed[CUSTOM_INPUT])
    return arguments


def call_arguments(arguments: str) -> object:
    """A ``tool_search_call``'s arguments as the object the item carries.

    Args:
        arguments: the JSON text the model produced.

    Returns:
        The parsed value, or the text when it is not JSON.
    """
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
