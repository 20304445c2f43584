"""The Responses stream events that carry text and arguments as they are generated.

``response.output_text.*``, ``response.reasoning_text.*`` and
``response.function_call_arguments.*``, ``response.reasoning_summary_part.*`` and
``response.reasoning_summary_text.*``, with the token logprobs they carry; ``types``
re-exports them and folds them into
``StreamEvent``. Kept apart only to keep modules small. Field names follow the official SDK.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "Logprob",
    "OutputTextDelta",
    "OutputTextDone",
    "ReasoningSummaryPartAdded",
    "ReasoningSummaryPartDone",
    "ReasoningSummaryTextDelta",
    "ReasoningSummaryTextDone",
    "ReasoningTextDelta",
    "ReasoningTextDone",
    "SummaryPart",
    "TopLogprob",
]


class TopLogprob(msgspec.Struct, frozen=True):
    """One alternative token of an output_text logprob."""

    token: str
    bytes: list[int]
    logprob: float


class Logprob(msgspec.Struct, frozen=True):
    """Log-probability of one output token."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob] = []


class OutputTextDelta(msgspec.Struct, tag_field="type", tag="response.output_text.delta"):
    """A fragment of answer text."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Logprob]
    sequence_number: int


class OutputTextDone(msgspec.Struct, tag_field="type", tag="response.output_text.done"):
    """The full text of an answer part."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Logprob]
    sequence_number: int


class ReasoningTextDelta(msgspec.Struct, tag_field="type", tag="response.reasoning_text.delta"):
    """A fragment of raw reasoning text."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    sequence_number: int


class ReasoningTextDone(msgspec.Struct, tag_field="type", tag="response.reasoning_text.done"):
    """The full raw reasoning text of a part."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    sequence_number: int


class FunctionCallArgumentsDelta(
    msgspec.Struct, tag_field="type", tag="response.function_call_arguments.delta"
):
    """A fragment of a call's JSON arguments."""

    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class FunctionCallArgumentsDone(
    msgspec.Struct, tag_field="type", tag="response.function_call_arguments.done"
):
    """A call's complete JSON arguments."""

    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int


class SummaryPart(msgspec.Struct, tag_field="type", tag="summary_text", kw_only=True):
    """A reasoning summary part as the summary-part events carry it."""

    text: str = ""


class ReasoningSummaryPartAdded(
    msgspec.Struct, tag_field="type", tag="response.reasoning_summary_part.added"
):
    """A summary part opens inside a reasoning item."""

    item_id: str
    output_index: int
    summary_index: int
    part: SummaryPart
    sequence_number: int


class ReasoningSummaryPartDone(
    msgspec.Struct, tag_field="type", tag="response.reasoning_summary_part.done"
):
    """A summary part is final."""

    item_id: str
    output_index: int
    summary_index: int
    part: SummaryPart
    sequence_number: int


class ReasoningSummaryTextDelta(
    msgspec.Struct, tag_field="type", tag="response.reasoning_summary_text.delta"
):
    """A fragment of a reasoning summary."""

    item_id: str
    output_index: int
    summary_index: int
    delta: str
    sequence_number: int


class ReasoningSummaryTextDone(
    msgspec.Struct, tag_field="type", tag="response.reasoning_summary_text.done"
):
    """The full text of a summary part."""

    item_id: str
    output_index: int
    summary_index: int
    text: str
    sequence_number: int
