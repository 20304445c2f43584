"""Top-level request fields sluice does not declare: refused, or accepted and named.

Newer SDKs keep adding request fields (prompt-cache options, service tiers, Anthropic's
``context_management``, ...). A client that sends one must not get a 400 for a field whose only
effect is on billing, caching or routing, but it should learn that sluice did not act on it: the
route names those in the ``x-sluice-ignored-fields`` response header, comma-separated, as
``x-sluice-ignored-tools`` names tools. A few fields would change the answer in a way sluice
cannot honour, or would be silently broken promises (a scheduling ``priority``, a per-request
``timeout``): those are refused with a 400 naming the field. A field sent as ``null`` means "the
default" and is neither named nor refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from shared.errors import InvalidRequest

__all__ = ["IGNORED_FIELDS_HEADER", "REFUSED_EVERYWHERE", "extra_fields", "refuse"]

IGNORED_FIELDS_HEADER = "x-sluice-ignored-fields"

# Refused in every format: the queue is first come, first served (vLLM's ``priority`` would
# reorder it), and nothing ends a request on a client-chosen deadline; accepting either would
# promise something sluice does not do. A client's own HTTP timeout (the SDKs' ``timeout``
# option, which is never sent in the body) still works: disconnecting cancels the request.
REFUSED_EVERYWHERE: Mapping[str, str] = {
    "priority": "priority is not supported: requests are served first come, first served",
    "timeout": (
        "timeout in the request body is not supported: set the client's own timeout; "
        "a disconnect cancels the request"
    ),
}

_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def extra_fields(body: bytes, declared: type[msgspec.Struct]) -> list[str]:
    """The top-level keys of an already-decoded body that ``declared`` has no field for.

    Args:
        body: the raw body, which decoded into ``declared`` (so it is a JSON object).
        declared: the format's request Struct.

    Returns:
        The keys set to something other than null, in body order.
    """
    known = set(declared.__struct_fields__)
    return [k for k, v in _KEYS.decode(body).items() if k not in known and bytes(v) != b"null"]


def refuse(fields: list[str], refused: Mapping[str, str] = REFUSED_EVERYWHERE) -> list[str]:
    """Raise for the first refused field; otherwise return the fields, all of them ignored.

    Args:
        fields: ``extra_fields``'s answer.
        refused: field name to the 400's message.

    Returns:
        ``fields`` unchanged.

    Raises:
        InvalidRequest: a field in ``refused``, named as the error's ``param``.
    """
    for field in fields:
        if field in refused:
            raise InvalidRequest(refused[field], param=field)
    return fields
