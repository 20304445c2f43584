"""Continuing a final assistant message (a prefill): the text the answer continues, and the
rendered prompt cut right after it.

Used by ``shared.prompt.PromptRenderer`` when a job has ``continue_final`` (Anthropic's final
assistant turn, vLLM's ``continue_final_message``, Ollama's open final message). The prompt
then ends inside that message, with no end-of-turn and no generation prompt.
"""

from __future__ import annotations

from shared.chat_template import TemplateError
from shared.grammar import forces_tool_call
from shared.jobs import GenerateRequest

__all__ = ["cut_after", "prefill_text"]


def prefill_text(job: GenerateRequest) -> str | None:
    """The text the answer continues (``job.continue_final``), stripped as Hugging Face's
    ``continue_final_message`` strips it; None when the job starts an answer of its own.

    Raises:
        TemplateError: the last message is not the assistant's, or holds tool calls, or a
            grammar constrains the whole answer (a structured output, a forced tool call).
    """
    if not job.continue_final:
        return None
    last = job.messages[-1] if job.messages else None
    if last is None or last.role != "assistant":
        raise TemplateError("only a final assistant message can be continued")
    if last.tool_calls:
        raise TemplateError("a final assistant message with tool calls cannot be continued")
    final = last.text.strip()
    if final and (job.constraint is not None or forces_tool_call(job)):
        # the grammar describes a whole answer: after a prefill it would force a second start
        # ("{" twice), and the answer would not be what the schema promised
        raise TemplateError(
            "a final assistant message cannot be continued under a structured output or a "
            "forced tool call: the schema constrains the whole answer"
        )
    return final


def cut_after(text: str, final: str) -> str:
    """``text`` up to the end of its last occurrence of ``final``: the template's end-of-turn
    after the final message goes, so the model writes on inside it (the way Hugging Face's and
    vLLM's ``continue_final_message`` do it; a template may change the message's surrounding
    whitespace, not its text)."""
    at = text.rfind(final)
    if at < 0:
        raise TemplateError(
            "the chat template does not render the final assistant message's text as written, "
            "so it cannot be continued"
        )
    return text[: at + len(final)]
