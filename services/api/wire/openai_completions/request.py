"""OpenAI legacy Completions request (``/v1/completions``): the body's Struct and the job.

Owns only the inbound direction: JSON body -> ``GenerateRequest`` (no messages: the prompt is
raw text, tokenized by ``prompt``) plus the options the route and projector need. No I/O.
Every rejection is an ``InvalidRequest`` naming its ``param`` (OpenAI's 400, never a 422).

``n`` choices of one prompt (checked against ``SLUICE_MAX_N`` at admission); a batch of prompts
and a ``best_of`` other than ``n`` are a 400 for now. ``max_tokens`` defaults to 16, as OpenAI's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.api.wire.common import WireInt, check_range, decode_body, error_location
from services.api.wire.sampling import check_sampling, vllm_top_k
from shared.errors import InvalidRequest
from shared.jobs import GenerateRequest, ReasoningControl, SamplingParams

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_LOGPROBS",
    "CompletionOptions",
    "CompletionRequest",
    "ParsedCompletion",
    "parse_request",
]

DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for this endpoint
MAX_LOGPROBS = 20  # OpenAI allows 5; vLLM 20, which the worker's top-k logprobs also bound


class _StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool | None = None


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=False):
    """The Completions body; unknown fields are accepted and ignored, as OpenAI's are."""

    model: str
    # A string, a list of strings, token ids, or a list of token-id lists: msgspec cannot put
    # several array types in one union, so the shape is checked by hand (``_prompt``).
    prompt: str | list[Any]
    suffix: str | None = None
    max_tokens: WireInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: WireInt | None = None
    min_p: float | None = None
    n: WireInt | None = None
    best_of: WireInt | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    logprobs: WireInt | None = None
    echo: bool | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    min_tokens: WireInt | None = None
    speculative: bool | None = None  # sluice's extension: false turns speculation off


class CompletionOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the route and projector need beyond the job."""

    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # the legacy int: how many alternatives per token


class ParsedCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request: the job (prompt not yet tokenized), the prompt and the options."""

    job: GenerateRequest
    # raw text, or token ids the client tokenized itself; several for a batch, whose choices
    # are prompt 0's n, then prompt 1's, ... (``job.n`` counts them all)
    prompts: list[str | list[int]]
    suffix: str | None
    options: CompletionOptions


_DECODER = msgspec.json.Decoder(CompletionRequest)


def parse_request(body: bytes, *, request_id: str) -> ParsedCompletion:
    """Decode and validate a Completions body.

    Args:
        body: the raw request body.
        request_id: the id the job will carry.

    Returns:
        The job (``raw_text``, no messages), the prompt and the projector options.

    Raises:
        InvalidRequest: bad JSON or field types, out-of-range values, or something sluice does
            not implement (``best_of`` other than ``n``, ``logit_bias``, ``echo`` with
            ``suffix``).
    """
    req = decode_body(_DECODER, body, _invalid)
    _check_unsupported(req)
    prompts = _prompts(req.prompt)
    per_prompt = 1 if req.n is None else req.n
    if per_prompt < 1:
        raise InvalidRequest("n must be at least 1", param="n")
    logprobs = req.logprobs
    check_range(logprobs, 0, MAX_LOGPROBS, "logprobs")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if req.min_tokens is not None and req.min_tokens < 0:
        raise InvalidRequest("min_tokens must not be negative", param="min_tokens")
    job = GenerateRequest(
        request_id=request_id,
        model=req.model,
        origin="openai_completions",
        sampling=_sampling(req),
        max_tokens=req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS,
        min_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos),
        speculative=req.speculative is not False,
        stop=_stop(req.stop),
        # Nobody reads reasoning apart here: the text keeps the model's markers (``raw_text``).
        reasoning=ReasoningControl(visible=True),
        raw_text=True,
        user=req.user,
        n=per_prompt * len(prompts),
        prompts=len(prompts),
    )
    options = CompletionOptions(
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        echo=bool(req.echo),
        logprobs=logprobs,
    )
    return ParsedCompletion(job=job, prompts=prompts, suffix=req.suffix, options=options)


def _invalid(exc: msgspec.ValidationError) -> InvalidRequest:
    message = str(exc)
    return InvalidRequest(message, param=error_location(message)[1])


def _check_unsupported(req: CompletionRequest) -> None:
    if req.best_of is not None and req.best_of != (req.n or 1):
        # best_of generates more than it returns and ranks by logprob: not the same as n
        raise InvalidRequest(
            "best_of is not supported: use n to get several completions", param="best_of"
        )
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", param="logit_bias")
    if req.echo and req.suffix is not None:
        # OpenAI refuses the pair too: the echoed prompt would have a hole in it.
        raise InvalidRequest("echo and suffix cannot be used together", param="echo")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(raw: str | list[Any]) -> list[str | list[int]]:
    """The request's prompts: a string, a list of token ids, or a batch (a list of strings
    or of token id lists), in order."""
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(_is_int(v) for v in raw):
        return [[int(v) for v in raw]]
    prompts: list[str | list[int]] = []
    for i, one in enumerate(raw):
        if isinstance(one, str):
            prompts.append(one)
        elif isinstance(one, list) and one and all(_is_int(v) for v in one):
            prompts.append([int(v) for v in one])
        else:
            raise InvalidRequest(
                "prompt must be a string, a list of token ids, or a list of strings or of "
                "token id lists",
                param=f"prompt[{i}]",
            )
    return prompts


def _sampling(req: CompletionRequest) -> SamplingParams:
    sampling = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=vllm_top_k(req.top_k),
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
    )
    # legacy completions name the number of alternatives ``logprobs``
    return check_sampling(sampling, renames={"top_logprobs": "logprobs"})


def _stop(raw: str | list[str] | None) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    return [s for s in stops if s]
