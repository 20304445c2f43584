"""Every Responses tool type: parsing, the model's view, and the items calls come back as.

The recorded Codex request bodies (``tests/fixtures/clients``) are the reference for what a real
client declares; the official SDK's types validate what sluice sends back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from openai.types.responses import (
    Response as SdkResponse,
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseToolSearchCall,
)

from services.api.wire.openai_responses import (
    Context,
    Projector,
    build_job,
    input_messages,
    parse_request,
    render,
    skeleton,
    tool_set,
)
from shared.accumulate import fold
from shared.errors import InvalidRequest
from shared.events import (
    AnyEvent,
    Finish,
    Start,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from shared.jobs import GenerateRequest
from tests.invariants import check_stream

FIXTURES = Path(__file__).parents[2] / "fixtures" / "clients"
RID = "resp_00000000000000000000abcd"
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
NAMESPACE = {
    "type": "namespace",
    "name": "crm",
    "description": "CRM tools",
    "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
        {"type": "custom", "name": "note", "description": "free text note"},
    ],
}
CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}
SEARCH = {
    "type": "tool_search",
    "execution": "client",
    "description": "Find tools",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
}
TOOLS = [NAMESPACE, CUSTOM, SEARCH, {"type": "web_search", "external_web_access": False}]


def _job(body: dict[str, Any]) -> GenerateRequest:
    req = parse_request(json.dumps(body).encode())
    conv = input_messages(req)
    return build_job(req, request_id=RID, conversation=conv, owner="", created=1.0)


def _skeleton(tools: list[Any] = TOOLS) -> Any:
    return skeleton(
        parse_request(json.dumps({"model": "m", "input": "x", "tools": tools}).encode()), RID, 1
    )


@pytest.mark.parametrize(
    "name", ["codex-0.169.0-responses.json", "codex-0.169.0-responses-unknown-model.json"]
)
def test_recorded_codex_requests_parse_with_every_tool(name: str) -> None:
    body = json.loads((FIXTURES / name).read_text())
    req = parse_request(json.dumps(body).encode())
    job = _job(body)
    names = {t.name for t in job.tools}
    assert {"exec_command", "write_stdin", "view_image"} <= names
    tools = tool_set(req)
    assert tools.ignored == ["web_search"]
    if name.endswith("unknown-model.json"):
        # Codex groups its sub-agent tools in a namespace for models it does not know.
        assert "multi_agent_v1.close_agent" in names
        assert tools.routes["multi_agent_v1.close_agent"].namespace == "multi_agent_v1"
    else:
        patch = next(t for t in job.tools if t.name == "apply_patch")
        assert patch.input_format is not None and patch.input_format["syntax"] == "lark"
        assert patch.parameters["required"] == ["input"]
        assert "tool_search" in names
    echo = skeleton(req, RID, 1)
    assert echo.tools == body["tools"]  # echoed as sent, hosted tools included


def test_model_sees_namespaced_custom_and_search_tools_but_not_hosted_ones() -> None:
    job = _job({"model": "m", "input": "x", "tools": TOOLS})
    assert [t.name for t in job.tools] == ["crm.lookup", "crm.note", "apply_patch", "tool_search"]
    search = job.tools[3]
    assert search.parameters == SEARCH["parameters"]


@pytest.mark.parametrize(
    ("choice", "named"),
    [
        ({"type": "custom", "name": "apply_patch"}, "apply_patch"),
        ({"type": "function", "name": "lookup", "namespace": "crm"}, "crm.lookup"),
        ({"type": "tool_search"}, "tool_search"),
    ],
)
def test_tool_choice_names_any_callable_tool(choice: dict[str, Any], named: str) -> None:
    job = _job({"model": "m", "input": "x", "tools": TOOLS, "tool_choice": choice})
    assert (job.tool_choice.mode, job.tool_choice.name) == ("named", named)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "name": "apply_patch"}},
            "tool_choice.name",
        ),
        ({"tools": [{"type": "warp_drive"}]}, "tools[0].type"),
        (
            {"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "mcp"}]}]},
            "tools[0].tools[0].type",
        ),
        ({"tools": [{"type": "custom"}]}, "tools[0]"),
    ],
)
def test_bad_tools_and_forced_hosted_tools_are_400s(body: dict[str, Any], param: str) -> None:
    req = parse_request(json.dumps({"model": "m", "input": "x", **body}).encode())
    with pytest.raises(InvalidRequest) as info:
        skeleton(req, RID, 1)
    assert info.value.param == param


def _call(name: str, arguments: str) -> list[AnyEvent]:
    half = len(arguments) // 2
    return [
        Start(request_id=RID, model="m", prompt_tokens=5),
        ToolCallStart(index=0, call_id="call_x1", name=name, token_ids=[1]),
        ToolCallArgsDelta(index=0, fragment=arguments[:half], token_ids=[2]),
        ToolCallArgsDelta(index=0, fragment=arguments[half:], token_ids=[3]),
        ToolCallEnd(index=0, arguments=arguments, token_ids=[4]),
        Usage(input_tokens=5, output_tokens=4),
        Finish(reason="tool_calls", token_ids=[5]),
    ]


def _stream(events: list[AnyEvent]) -> list[dict[str, Any]]:
    check_stream(events)
    projector = Projector(Context(skeleton=_skeleton()))
    frames = [f for e in events for f in projector.feed(e)] + projector.close()
    return [json.loads(f.data) for f in frames]


def _both(events: list[AnyEvent]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    streamed = _stream(events)
    folded = json.loads(msgspec.json.encode(render(fold(events), _skeleton())))
    assert streamed[-1]["response"] == folded, "stream and fold must agree"
    SdkResponse.model_validate(folded)  # the official SDK's own types accept it
    return streamed, folded


def test_custom_tool_call_streams_and_folds_as_custom_tool_call() -> None:
    arguments = json.dumps({"input": PATCH})
    streamed, folded = _both(_call("apply_patch", arguments))
    item = folded["output"][0]
    call = ResponseCustomToolCall.model_validate(item)
    assert (call.name, call.input, call.call_id, call.namespace) == (
        "apply_patch",
        PATCH,
        "call_x1",
        None,
    )
    assert item["id"].startswith("ctc_") and "namespace" not in item
    kinds = [e["type"] for e in streamed]
    assert "response.function_call_arguments.delta" not in kinds
    delta = next(e for e in streamed if e["type"] == "response.custom_tool_call_input.delta")
    done = next(e for e in streamed if e["type"] == "response.custom_tool_call_input.done")
    assert delta["delta"] == done["input"] == PATCH
    added = next(e for e in streamed if e["type"] == "response.output_item.added")
    assert added["item"] == {**item, "status": "in_progress", "input": ""}


def test_custom_tool_input_that_is_not_the_offered_shape_is_passed_through() -> None:
    _, folded = _both(_call("apply_patch", '{"patch": 1}'))
    assert folded["output"][0]["input"] == '{"patch": 1}'


def test_namespaced_calls_name_the_tool_and_its_namespace_apart() -> None:
    _, folded = _both(_call("crm.lookup", '{"id": 7}'))
    call = ResponseFunctionToolCall.model_validate(folded["output"][0])
    assert (call.name, call.namespace, call.arguments) == ("lookup", "crm", '{"id": 7}')
    _, folded = _both(_call("crm.note", json.dumps({"input": "call back"})))
    custom = ResponseCustomToolCall.model_validate(folded["output"][0])
    assert (custom.name, custom.namespace, custom.input) == ("note", "crm", "call back")


def test_tool_search_call_carries_its_arguments_as_an_object() -> None:
    _, folded = _both(_call("tool_search", '{"query": "calendar"}'))
    call = ResponseToolSearchCall.model_validate(folded["output"][0])
    assert (call.arguments, call.execution, call.call_id) == (
        {"query": "calendar"},
        "client",
        "call_x1",
    )
    assert call.id.startswith("tsc_")


def test_plain_function_calls_keep_their_wire_shape() -> None:
    _, folded = _both(_call("undeclared", "{}"))
    assert set(folded["output"][0]) == {"type", "id", "status", "arguments", "call_id", "name"}


def test_replayed_custom_namespaced_and_search_items_become_turns() -> None:
    loaded = {"type": "function", "name": "calendar", "parameters": {"type": "object"}}
    items = [
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        {
            "type": "function_call",
            "call_id": "c2",
            "name": "lookup",
            "namespace": "crm",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c2", "output": "found"},
        {
            "type": "tool_search_call",
            "call_id": "c3",
            "arguments": {"query": "cal"},
            "execution": "client",
        },
        {"type": "tool_search_output", "call_id": "c3", "execution": "client", "tools": [loaded]},
    ]
    job = _job({"model": "m", "input": items, "tools": TOOLS})
    calls = [c for m in job.messages for c in m.tool_calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("apply_patch", {"input": PATCH}),
        ("crm.lookup", {}),
        ("tool_search", {"query": "cal"}),
    ]
    results = [(m.tool_call_id, m.name, m.text) for m in job.messages if m.role == "tool"]
    assert results[:2] == [("c1", "apply_patch", "Done!"), ("c2", "crm.lookup", "found")]
    assert results[2][:2] == ("c3", "tool_search") and json.loads(results[2][2]) == [loaded]
    # A tool the client's search loaded is callable from then on.
    assert "calendar" in {t.name for t in job.tools}


def test_function_tools_are_strict_unless_the_client_says_false() -> None:
    """The Responses API's default for ``strict`` is true: an omitted (or null) ``strict``
    constrains the arguments and is echoed as true; an explicit false stays false."""
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools: list[dict[str, Any]] = [
        {"type": "function", "name": "omitted", "parameters": params},
        {"type": "function", "name": "null", "parameters": params, "strict": None},
        {"type": "function", "name": "loose", "parameters": params, "strict": False},
        {
            "type": "namespace",
            "name": "ns",
            "tools": [{"type": "function", "name": "inner", "parameters": params}],
        },
    ]
    req = parse_request(json.dumps({"model": "m", "input": "hi", "tools": tools}).encode())
    job = build_job(req, request_id="resp_1", conversation=input_messages(req), owner="", created=0)
    assert {t.name: t.strict for t in job.tools} == {
        "omitted": True,
        "null": True,
        "loose": False,
        "ns.inner": True,
    }
    echo = json.loads(msgspec.json.encode(skeleton(req, "resp_1", 0)))["tools"]
    assert [t.get("strict") for t in echo[:3]] == [True, True, False]
    assert echo[3]["tools"][0]["strict"] is True
    plain = parse_request(json.dumps({"model": "m", "input": "x", "tools": tools[:3]}).encode())
    sdk = SdkResponse.model_validate(json.loads(msgspec.json.encode(skeleton(plain, "r", 0))))
    assert [getattr(t, "strict", None) for t in sdk.tools] == [True, True, False]
