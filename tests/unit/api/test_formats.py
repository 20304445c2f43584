"""Each wire format's router owns its path prefix (``services.api.formats``)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from fastapi.routing import APIRoute

import services.api.routes
from services.api.formats import FormatRouter, format_of, owner_of
from services.api.wire import anthropic_messages, ollama, openai_errors

# The routes that belong to no wire format: probes, the model list, tokenization.
UNOWNED = {"/", "/healthz", "/readyz", "/metrics", "/v1/models", "/v1/models/{model_id:path}"}
UNOWNED |= {"/tokenize", "/detokenize"}


def test_every_route_is_a_format_s_or_known_to_be_shared() -> None:
    """A route added to a format module lands under its prefix, so metrics and errors follow."""
    modules = pkgutil.iter_modules(services.api.routes.__path__, "services.api.routes.")
    routers = [importlib.import_module(m.name).router for m in modules]
    paths = {r.path for router in routers for r in router.routes if isinstance(r, APIRoute)}
    owned = {p for p in paths if owner_of(p) is not None}
    assert paths - owned == UNOWNED
    assert {format_of(p) for p in owned} == {
        "openai_chat",
        "openai_completions",
        "openai_responses",
        "anthropic_messages",
        "native",
        "ollama",
    }


@pytest.mark.parametrize(
    ("path", "fmt", "envelope"),
    [
        ("/v1/chat/completions", "openai_chat", openai_errors.error_body),
        ("/v1/chat/completions/chatcmpl-1/events", "openai_chat", openai_errors.error_body),
        ("/v1/completions", "openai_completions", openai_errors.error_body),
        ("/v1/messages/count_tokens", "anthropic_messages", anthropic_messages.error_body),
        ("/v1/messages/unknown/route", "anthropic_messages", anthropic_messages.error_body),
        ("/api/tags", "ollama", ollama.error_body),
        ("/v1/requests/r1/cancel", "native", openai_errors.error_body),
    ],
)
def test_a_path_finds_its_format(path: str, fmt: str, envelope: object) -> None:
    owner = owner_of(path)
    assert owner is not None and owner.format == fmt and owner.envelope is envelope
    assert format_of(path) == fmt


@pytest.mark.parametrize("path", ["/v1/models", "/v1/messagesx", "/apix/chat", "/tokenize"])
def test_a_prefix_is_a_whole_path_segment(path: str) -> None:
    assert owner_of(path) is None and format_of(path) == "other"


def test_two_formats_cannot_share_a_prefix() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        FormatRouter("/v1/messages/batches", "batches", openai_errors.error_body)
