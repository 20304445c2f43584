"""The sampling limits every wire format enforces: one table of ranges, one ``check()``.

The worker decodes many requests in one batch, so a value it cannot sample with must be refused
at the door, in the caller's format, rather than fail inside a shared decode step. Each format
maps its own field names onto ``SamplingParams`` (Chat's ``repetition_penalty`` is Ollama's
``options.repeat_penalty``, the native API's ``sampling.repetition_penalty``) and converts its
own "off" spellings (vLLM's ``top_k`` of -1 or 0) before the check, so the ranges themselves are
the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from services.api.wire.common import check_range
from shared.errors import InvalidRequest
from shared.jobs import SamplingParams

__all__ = ["LIMITS", "SamplingLimits", "check_sampling", "vllm_top_k"]

# What the job's msgpack holds: a larger number is a 400, not a 500. A seed may use all 64 bits
# unsigned, as the worker's sampler reads it.
_MAX_INT, _MIN_INT, _MAX_SEED = 2**63 - 1, -(2**63), 2**64 - 1


class SamplingLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The closed range each sampling knob may take.

    ``top_p`` 0 keeps only the most likely token (the nucleus always holds it), and
    ``repetition_penalty`` must stay positive because the sampler divides by it.
    """

    temperature: tuple[float, float] = (0.0, 2.0)
    top_p: tuple[float, float] = (0.0, 1.0)
    top_k: tuple[int, int] = (0, _MAX_INT)
    min_p: tuple[float, float] = (0.0, 1.0)
    seed: tuple[int, int] = (_MIN_INT, _MAX_SEED)
    presence_penalty: tuple[float, float] = (-2.0, 2.0)
    frequency_penalty: tuple[float, float] = (-2.0, 2.0)
    repetition_penalty: tuple[float, float] = (1e-6, 100.0)
    top_logprobs: tuple[int, int] = (0, 20)

    def check(self, s: SamplingParams, name: Callable[[str], str] = str) -> SamplingParams:
        """Refuse a value outside its range, naming the field as the caller's format spells it.

        Args:
            s: the job's sampling parameters, as the wire format mapped them.
            name: the format's name for a ``SamplingParams`` field (for the error's ``param``).

        Returns:
            ``s``, unchanged.

        Raises:
            InvalidRequest: a value out of range, or ``top_logprobs`` without ``logprobs``.
        """
        for field in self.__struct_fields__:
            low, high = getattr(self, field)
            check_range(getattr(s, field), low, high, name(field))
        if s.top_logprobs and not s.logprobs:
            param = name("top_logprobs")
            raise InvalidRequest(f"{param} requires logprobs: true", param=param)
        return s


LIMITS = SamplingLimits()


def check_sampling(
    s: SamplingParams, prefix: str = "", renames: Mapping[str, str] | None = None
) -> SamplingParams:
    """``LIMITS.check`` with the format's field names: ``prefix`` before each (``options.``),
    except the fields in ``renames``, which give the format's whole name for them.

    Returns:
        ``s``, unchanged.
    """
    renamed = renames or {}
    return LIMITS.check(s, lambda field: renamed.get(field) or prefix + field)


def vllm_top_k(top_k: int | None) -> int | None:
    """vLLM's spelling of "no top-k", 0 or -1, as the job's None; any other value is kept (and a
    negative one then refused by the check)."""
    return None if top_k in (0, -1) else top_k
