"""OpenAI Chat Completions tools: ``tools`` and ``tool_choice`` into the job's tool fields.

Function tools are offered to the model; ``custom`` (freeform) tools are accepted and left out,
since Chat has no freeform call item that every client parses (the route names them in the
``x-sluice-ignored-tools`` header), and forcing one is a 400.
"""

from __future__ import annotations

import msgspec

from services.api.wire.common import JsonObject
from shared.errors import InvalidRequest
from shared.jobs import ToolChoice, ToolDef

__all__ = ["ChatTool", "parse_tool_choice", "parse_tools"]


class _FunctionDef(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, forbid_unknown_fields=False):
    """One entry of the body's ``tools``: a function, or a ``custom`` tool left out."""

    type: str
    function: _FunctionDef | None = None
    custom: JsonObject | None = None


def parse_tools(raw: list[ChatTool] | None) -> tuple[list[ToolDef], list[str]]:
    """The function tools offered to the model, and the names of the ``custom`` tools left out.

    Raises:
        InvalidRequest: a tool of another type, or a custom tool without a name.
    """
    out: list[ToolDef] = []
    ignored: list[str] = []
    for i, tool in enumerate(raw or []):
        if tool.type == "custom":
            # Chat has no item for a freeform call that every client parses: like a hosted
            # tool, a custom tool is accepted, kept out of the prompt and named in a header.
            name = tool.custom.get("name") if isinstance(tool.custom, dict) else None
            if not isinstance(name, str):
                raise InvalidRequest("custom tools need custom.name", param=f"tools[{i}].custom")
            ignored.append(name)
            continue
        if tool.type != "function" or tool.function is None:
            raise InvalidRequest(
                f"tool type {tool.type!r} is not supported (function tools only)",
                param=f"tools[{i}]",
            )
        fn = tool.function
        out.append(
            ToolDef(
                name=fn.name,
                description=fn.description,
                parameters=fn.parameters or {},
                strict=bool(fn.strict),
            )
        )
    return out, ignored


def parse_tool_choice(
    raw: str | JsonObject | None, tools: list[ToolDef], ignored: list[str]
) -> ToolChoice:
    """The job's tool choice; forcing an ignored (custom) or unknown tool is a 400.

    Raises:
        InvalidRequest: an unknown choice, a forced tool that is not offered.
    """
    names = {t.name for t in tools}
    if raw is None:
        return ToolChoice(mode="auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidRequest(f"unknown tool_choice {raw!r}", param="tool_choice")
        if raw == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        return ToolChoice(mode=raw)  # type: ignore[arg-type]  # narrowed by the check above
    if raw.get("type") == "custom":
        custom = raw.get("custom")
        forced = custom.get("name") if isinstance(custom, dict) else None
        raise InvalidRequest(
            f"tool_choice forces the custom tool {forced!r}, which this server does not offer "
            f"to the model (ignored: {', '.join(ignored) or 'none'})",
            param="tool_choice",
        )
    fn = raw.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if raw.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise InvalidRequest(f"tool_choice names unknown tool {name!r}", param="tool_choice")
    return ToolChoice(mode="named", name=name)
