"""Thinking signatures and Responses ``encrypted_content``: signed, verified, restored.

One key per deployment; a block sluice signed comes back intact, restored (omitted display,
Codex's summary-only replay) or, edited, is a 400; empty and foreign tokens are accepted.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from services.api.wire import anthropic_messages, openai_responses
from services.api.wire.reasoning_tokens import PREFIX, ReasoningSigner, derive_key
from shared.accumulate import fold
from shared.errors import InvalidRequest
from tests.factories import SCENARIOS

SIGNER = ReasoningSigner(derive_key(b"deployment secret"))
OTHER = ReasoningSigner(derive_key(b"another deployment"))
THOUGHT = "The user greets me."  # what tests.factories' reasoning scenario thinks


def test_tokens_round_trip_and_reject_tampering() -> None:
    token = SIGNER.sign(THOUGHT)
    assert token.startswith(PREFIX)
    assert SIGNER.open(token, "p") == THOUGHT
    assert SIGNER.check(token, "", "p") == THOUGHT  # omitted text is restored
    assert SIGNER.check(token, THOUGHT, "p") == THOUGHT
    assert SIGNER.open("", "p") is None and SIGNER.open("EqQBCkgIARAB...", "p") is None
    assert SIGNER.check("anthropic-signature", "their text", "p") == "their text"
    for bad in (OTHER.sign(THOUGHT), token[:-2] + "AA", PREFIX + "garbage"):
        with pytest.raises(InvalidRequest):
            SIGNER.open(bad, "p")
    with pytest.raises(InvalidRequest) as info:
        SIGNER.check(token, "An edited thought.", "p")
    assert info.value.param == "p"


def _anthropic_frames(show: bool) -> list[dict[str, Any]]:
    ctx = anthropic_messages.Context(
        message_id="msg_1", model="m", show_thinking=show, signer=SIGNER
    )
    projector = anthropic_messages.Projector(ctx)
    frames = [f for e in SCENARIOS["reasoning"]() for f in projector.feed(e)] + projector.close()
    return [json.loads(f.data) for f in frames]


@pytest.mark.parametrize("show", [True, False])
def test_anthropic_thinking_blocks_are_signed_streamed_and_folded(show: bool) -> None:
    frames = _anthropic_frames(show)
    (signature,) = [
        f["delta"]["signature"]
        for f in frames
        if f.get("delta", {}).get("type") == "signature_delta"
    ]
    assert SIGNER.open(signature, "p") == THOUGHT  # the whole text, even when not displayed
    ctx = anthropic_messages.Context(
        message_id="msg_1", model="m", show_thinking=show, signer=SIGNER
    )
    body = msgspec.to_builtins(anthropic_messages.render(fold(SCENARIOS["reasoning"]()), ctx))
    assert body["content"][0] == {
        "type": "thinking",
        "thinking": THOUGHT if show else "",
        "signature": signature,
    }


def _replay(thinking: str, signature: str) -> anthropic_messages.MessagesRequest:
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": thinking, "signature": signature},
                    {"type": "text", "text": "Hi there."},
                ],
            },
            {"role": "user", "content": "and?"},
        ],
    }
    req = anthropic_messages.parse_request(json.dumps(body).encode())
    return anthropic_messages.restore_thinking(req, SIGNER)


def _reasoning_of(req: anthropic_messages.MessagesRequest) -> str | None:
    return anthropic_messages.build_job(req, request_id="msg_2").messages[1].reasoning


def test_anthropic_thinking_sent_back_is_verified_and_restored() -> None:
    token = SIGNER.sign(THOUGHT)
    assert _reasoning_of(_replay(THOUGHT, token)) == THOUGHT
    assert _reasoning_of(_replay("", token)) == THOUGHT  # display: omitted, restored
    assert _reasoning_of(_replay("foreign", "EqQBCkgIARAB")) == "foreign"
    assert _reasoning_of(_replay("unsigned", "")) == "unsigned"
    for thinking, signature in (("An edited thought.", token), (THOUGHT, OTHER.sign(THOUGHT))):
        with pytest.raises(InvalidRequest) as info:
            _replay(thinking, signature)
        assert info.value.message == "messages.1.content.0: Invalid `signature` in `thinking` block"


def _skeleton() -> Any:
    req = openai_responses.parse_request(b'{"model": "m", "input": "x"}')
    return openai_responses.skeleton(req, "resp_000000000000000000000011", 1)


def test_responses_encrypted_content_only_when_included_and_it_restores() -> None:
    events = SCENARIOS["reasoning"]()
    plain = openai_responses.render(fold(events), _skeleton())
    assert "encrypted_content" not in msgspec.to_builtins(plain.output[0])
    signed = openai_responses.render(fold(events), _skeleton(), signer=SIGNER)
    projector = openai_responses.Projector(
        openai_responses.Context(skeleton=_skeleton(), signer=SIGNER)
    )
    frames = [json.loads(f.data) for e in events for f in projector.feed(e)]
    assert frames[-1]["response"] == msgspec.to_builtins(signed)
    item = msgspec.to_builtins(signed.output[0])
    assert SIGNER.open(item["encrypted_content"], "p") == THOUGHT
    # Codex with store: false sends the item back with the token (and maybe only a summary).
    replay = {"type": "reasoning", "summary": [], "encrypted_content": item["encrypted_content"]}
    messages = openai_responses.items_to_messages(
        [{"role": "user", "content": "hi"}, replay, {"role": "assistant", "content": "Hi there."}],
        signer=SIGNER,
    )
    assert messages[-1].reasoning == THOUGHT
    forged = {**replay, "encrypted_content": OTHER.sign("injected")}
    with pytest.raises(InvalidRequest) as info:
        openai_responses.items_to_messages(
            [forged, {"role": "assistant", "content": "x"}], signer=SIGNER
        )
    assert info.value.param == "input[0].encrypted_content"
    foreign = {**replay, "encrypted_content": "gAAAAABo-openai-blob"}
    kept = openai_responses.items_to_messages(
        [foreign, {"role": "assistant", "content": "x"}], signer=SIGNER
    )
    assert kept[-1].reasoning is None
