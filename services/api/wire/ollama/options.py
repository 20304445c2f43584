"""Ollama's ``options`` object: the sampling knobs sluice honours, and the rest accepted.

Honoured: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty``, ``num_predict``, ``stop`` and ``num_ctx`` (a
context window no larger than the model's: the route caps the completion so that prompt and
completion fit in it; a larger one is the model's own). Every other option Ollama knows
(``num_batch``, ``num_gpu``, ``mirostat``, ``tfs_z``, ``typical_p``, ``num_thread``, ...) tunes a
llama.cpp runner sluice does not have, and is accepted and ignored, as Ollama ignores options
it does not know. Ollama's sentinels keep their meaning: ``num_predict`` -1 (unbounded) or -2
(fill the context) and a negative ``seed`` (random) mean "not set"; ``top_k`` 0 means no top-k.
"""

from __future__ import annotations

import msgspec

from services.api.wire.common import WireInt
from services.api.wire.sampling import check_sampling
from shared.errors import InvalidRequest
from shared.jobs import SamplingParams

__all__ = ["Options", "max_tokens", "num_ctx", "sampling", "stops"]

# Ollama's names for the job's sampling fields: ``top_logprobs`` is top-level, not an option.
_NAMES = {"repetition_penalty": "options.repeat_penalty", "top_logprobs": "top_logprobs"}


class Options(msgspec.Struct, forbid_unknown_fields=False):
    """The options sluice reads; unknown ones are ignored."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: WireInt | None = None
    min_p: float | None = None
    seed: WireInt | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_predict: WireInt | None = None
    num_ctx: WireInt | None = None
    stop: str | list[str] | None = None


def sampling(o: Options | None, *, logprobs: bool, top_logprobs: int | None) -> SamplingParams:
    """The job's sampling parameters.

    Raises:
        InvalidRequest: a value outside the range the worker samples with.
    """
    o = o or Options()
    sampling = SamplingParams(
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k or None,  # 0 is Ollama's "no top-k"
        min_p=o.min_p,
        seed=o.seed if o.seed is not None and o.seed >= 0 else None,
        presence_penalty=o.presence_penalty or 0.0,
        frequency_penalty=o.frequency_penalty or 0.0,
        repetition_penalty=o.repeat_penalty if o.repeat_penalty is not None else 1.0,
        # Ollama returns logprobs when ``top_logprobs`` alone is set.
        logprobs=logprobs or bool(top_logprobs),
        top_logprobs=top_logprobs or 0,
    )
    return check_sampling(sampling, "options.", _NAMES)


def max_tokens(o: Options | None) -> int | None:
    """``num_predict`` as the job's ``max_tokens`` (0 and the negative sentinels: no limit)."""
    if o is None or o.num_predict is None or o.num_predict <= 0:
        return None
    return o.num_predict


def num_ctx(o: Options | None) -> int | None:
    """The requested context window, if any.

    Raises:
        InvalidRequest: a window that is not positive.
    """
    if o is None or o.num_ctx is None:
        return None
    if o.num_ctx < 1:
        raise InvalidRequest("options.num_ctx must be positive", param="options.num_ctx")
    return o.num_ctx


def stops(o: Options | None) -> list[str]:
    """The stop sequences (a single string is one sequence)."""
    if o is None or o.stop is None:
        return []
    raw = [o.stop] if isinstance(o.stop, str) else o.stop
    return [s for s in raw if s]
