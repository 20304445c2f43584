"""The native API's request: ``GenerateRequest`` itself as JSON, less what the server assigns.

Unknown fields are refused (the job is sluice's own contract, so a typo is an error, not a
field silently dropped), and every value is checked here as the other formats check theirs.
"""

from __future__ import annotations

import msgspec

from services.api.wire.common import UNDECODABLE, check_range, undecodable
from services.api.wire.constraints import check_tool_schemas
from services.api.wire.sampling import check_sampling
from shared.errors import InvalidRequest
from shared.grammar import check_constraint
from shared.jobs import GenerateRequest

__all__ = ["parse_job"]

_SERVER_FIELDS = ("request_id", "owner", "created", "prompt_token_ids", "prompt_text", "choice")
_JOB_FIELDS = frozenset(f.name for f in msgspec.structs.fields(GenerateRequest))
# What the job's msgpack holds (``wire.common.WireInt``): a larger number is a 400, not a 500.
_MIN_INT, _MAX_INT = -(2**63), 2**63 - 1


def parse_job(body: bytes, rid: str) -> GenerateRequest:
    """The body as a canonical job with the server's id, every value checked.

    Args:
        body: the raw JSON body: ``GenerateRequest`` without the fields the server assigns.
        rid: the new request id.

    Returns:
        The job, ``origin="native"``.

    Raises:
        InvalidRequest: bad JSON, a server-assigned or unknown field, a wrong type, or a value
            out of range.
    """
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    except UNDECODABLE as exc:
        raise undecodable(exc) from exc
    if not isinstance(raw, dict):
        raise InvalidRequest("the body must be a JSON object")
    for name in raw:
        if name in _SERVER_FIELDS:
            raise InvalidRequest(f"'{name}' is set by the server", param=name)
        if name == "n" and raw[name] != 1:
            # one request, one event stream here: several choices are several requests
            raise InvalidRequest("n must be 1 on the native API: submit n requests", param="n")
        if name not in _JOB_FIELDS:
            raise InvalidRequest(f"unknown field '{name}'", param=name)
    if "model" not in raw:
        raise InvalidRequest("'model' is required", param="model")
    raw["request_id"] = rid
    raw["origin"] = "native"
    try:
        job = msgspec.convert(raw, GenerateRequest)
    except msgspec.ValidationError as exc:
        message = str(exc)
        _, _, path = message.partition(" - at `$.")
        raise InvalidRequest(message, param=path.rstrip("`") or None) from exc
    check_sampling(job.sampling, "sampling.")
    if job.min_tokens < 0:
        raise InvalidRequest("min_tokens must not be negative", param="min_tokens")
    check_range(job.min_tokens, 0, _MAX_INT, "min_tokens")
    check_range(job.max_tokens, 1, _MAX_INT, "max_tokens")
    check_range(job.reasoning.budget_tokens, _MIN_INT, _MAX_INT, "reasoning.budget_tokens")
    if job.constraint is not None:
        check_constraint(job.constraint, "constraint")
    check_tool_schemas(job.tools, job.tool_choice, lambda i: f"tools[{i}].parameters")
    return job
