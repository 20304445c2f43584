"""API-key authentication: who is calling, as an owner id.

Keys come from ``Settings.all_api_keys()``; no keys configured means auth is off and every
caller is the anonymous owner ``""``. The owner id stored with a request is an HMAC-SHA-256 of
the key under the deployment secret: ``SLUICE_OWNER_SECRET``, else one the first API replica
generates into Redis (``state.load_owner_secret``). So Redis never holds a usable key, only the
creating key can read or replay a request, and someone who reads the stored ids cannot test
guessed keys against them without the secret as well.

``/metrics`` is guarded by ``authorize_metrics``: ``SLUICE_METRICS_KEY`` when set, else any API
key when keys are configured, else nothing (a deployment without keys has nothing to hide it by).
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from shared.errors import AuthenticationFailed

__all__ = ["authenticate", "authorize_metrics", "owner_id", "presented_key"]

_STATE_ATTR = "sluice_owner"


def owner_id(key: str, secret: str | None = None) -> str:
    """The owner id of an API key.

    Args:
        key: the raw key.
        secret: the deployment secret; None for the unkeyed hash.

    Returns:
        Hex HMAC-SHA-256 of the key under ``secret``, or hex SHA-256 without one.
    """
    if secret:
        return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()
    return hashlib.sha256(key.encode()).hexdigest()


def presented_key(request: Request) -> str | None:
    """The key the caller sent: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``.

    Args:
        request: the request.

    Returns:
        The key, or None when neither header carries one.
    """
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = request.headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


async def authenticate(request: Request) -> str:
    """Check the caller's key and return its owner id (cached on the request).

    Args:
        request: the request; ``request.app.state.sluice.settings`` holds the keys.

    Returns:
        The owner id (``owner_id`` of the key), or ``""`` when auth is off.

    Raises:
        AuthenticationFailed: keys are configured and the request has none or an unknown one.
    """
    cached = getattr(request.state, _STATE_ATTR, None)
    if isinstance(cached, str):
        return cached
    settings = request.app.state.sluice.settings
    keys = settings.all_api_keys()
    if not keys:
        owner = ""
    else:
        key = presented_key(request)
        if key is None:
            raise AuthenticationFailed(
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        # compare_digest on every key: the time taken must not reveal which prefix matched.
        matched = False
        for candidate in keys:
            matched |= hmac.compare_digest(candidate.encode(), key.encode())
        if not matched:
            raise AuthenticationFailed("invalid API key")
        owner = owner_id(key, request.app.state.sluice.owner_secret)
    setattr(request.state, _STATE_ATTR, owner)
    return owner


async def authorize_metrics(request: Request) -> None:
    """Guard ``GET /metrics``: per-route counts and latencies are no business of anonymous callers
    where the API is locked.

    Args:
        request: the request.

    Raises:
        AuthenticationFailed: ``SLUICE_METRICS_KEY`` is set and was not presented, or it is unset,
            API keys are configured and none of them was presented.
    """
    settings = request.app.state.sluice.settings
    if not settings.metrics_key:
        if settings.all_api_keys():
            await authenticate(request)
        return
    # Only the metrics key: a scraper's credential should not be one that can generate text.
    key = presented_key(request)
    if key is None or not hmac.compare_digest(key.encode(), settings.metrics_key.encode()):
        raise AuthenticationFailed("/metrics needs 'Authorization: Bearer <SLUICE_METRICS_KEY>'")
