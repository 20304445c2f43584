"""Find a model's reasoning and tool-call markers in its tokenizer, without model-name switches.

Reasoning markers are known open/close pairs that must both be single tokens (added tokens), so
the router can flip state on token ids alone. Tool-call styles: Hermes/Qwen ``<tool_call>`` and
``</tool_call>`` tokens, Mistral's ``[TOOL_CALLS]`` token, and the Llama 3 JSON convention when
the chat template declares it (it asks for ``"parameters"`` objects, or uses ``ipython`` /
``<|python_tag|>``).
"""

from __future__ import annotations

import tokenizers

from shared.model_card import ReasoningMarkers, ToolMarkers

__all__ = ["REASONING_PAIRS", "detect_markers"]

REASONING_PAIRS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("[THINK]", "[/THINK]"),
    ("<thought>", "</thought>"),
    ("<reasoning>", "</reasoning>"),
)


def _added_ids(tokenizer: tokenizers.Tokenizer) -> dict[str, int]:
    return {tok.content: i for i, tok in tokenizer.get_added_tokens_decoder().items()}


def _reasoning(added: dict[str, int]) -> ReasoningMarkers | None:
    for open_text, close_text in REASONING_PAIRS:
        open_id, close_id = added.get(open_text), added.get(close_text)
        if open_id is not None and close_id is not None:
            return ReasoningMarkers(
                open=open_text, close=close_text, open_id=open_id, close_id=close_id
            )
    return None


def _tools(added: dict[str, int], chat_template: str) -> ToolMarkers | None:
    open_id, close_id = added.get("<tool_call>"), added.get("</tool_call>")
    if open_id is not None and close_id is not None:
        return ToolMarkers(
            style="hermes",
            open="<tool_call>",
            close="</tool_call>",
            open_id=open_id,
            close_id=close_id,
        )
    mistral_id = added.get("[TOOL_CALLS]")
    if mistral_id is not None:
        return ToolMarkers(style="mistral", open="[TOOL_CALLS]", open_id=mistral_id)
    declares_llama3 = (
        '"parameters"' in chat_template
        or "ipython" in chat_template
        or "<|python_tag|>" in chat_template
    )
    if declares_llama3:
        tag_id = added.get("<|python_tag|>")
        return ToolMarkers(
            style="llama3_json",
            open="<|python_tag|>" if tag_id is not None else None,
            open_id=tag_id,
        )
    return None


def detect_markers(
    tokenizer: tokenizers.Tokenizer, chat_template: str
) -> tuple[ReasoningMarkers | None, ToolMarkers | None]:
    """Probe the tokenizer's added tokens (and the template) for reasoning and tool markers.

    Args:
        tokenizer: The model's tokenizer.
        chat_template: The model's chat template source.

    Returns:
        ``(reasoning, tools)``; either is None when the model has no such markers.
    """
    added = _added_ids(tokenizer)
    return _reasoning(added), _tools(added, chat_template)
