"""Opaque reasoning tokens: Anthropic thinking ``signature``s and Responses ``encrypted_content``.

A token carries the reasoning text itself (compressed) and an HMAC-SHA256 tag under the
deployment's secret, so a client that sends a reasoning block back gets it restored exactly as
sluice produced it, and an edited block is caught: every replica shares the secret (setting
``SLUICE_REASONING_SECRET``, or one generated once and kept in Redis), so any replica checks
any other's tokens. The text is signed, not encrypted: sluice already showed it to the client
(or, with Anthropic's ``display: omitted``, chose not to; the token restores it on the way
back in). Tokens from other servers (Anthropic's, OpenAI's) and empty ones are not sluice's and
are left alone, as documented. Pure: the key is passed in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import zlib

from shared.errors import InvalidRequest

__all__ = ["PREFIX", "ReasoningSigner", "derive_key"]

PREFIX = "sluice1."
_TAG_BYTES = 32


def derive_key(secret: bytes) -> bytes:
    """The signing key for a deployment secret (kept apart from any other use of it).

    Args:
        secret: the configured or generated secret.

    Returns:
        32 bytes.
    """
    return hmac.new(secret, b"sluice reasoning tokens v1", hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ReasoningSigner:
    """Makes and opens reasoning tokens under one key."""

    def __init__(self, key: bytes) -> None:
        """Use ``key`` (from ``derive_key``)."""
        self._key = key

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def sign(self, text: str) -> str:
        """The token for a reasoning text.

        Args:
            text: the whole reasoning of one block or item.

        Returns:
            ``sluice1.<payload>.<tag>``, URL-safe base64.
        """
        payload = zlib.compress(text.encode())
        return f"{PREFIX}{_b64(payload)}.{_b64(self._tag(payload))}"

    def open(self, token: str | None, param: str) -> str | None:
        """The reasoning a token restores, None for a token that is not sluice's.

        Args:
            token: the signature or ``encrypted_content`` a client sent back.
            param: where it sits in the request, for the error.

        Returns:
            The signed text; None for empty and foreign tokens (accepted, nothing restored).

        Raises:
            InvalidRequest: a sluice token whose tag does not match (edited, or signed by a
                deployment with another secret).
        """
        if not token or not token.startswith(PREFIX):
            return None
        body, _, tag = token.removeprefix(PREFIX).partition(".")
        try:
            payload, expected = _unb64(body), _unb64(tag)
        except ValueError:
            payload, expected = b"", b""
        if len(expected) != _TAG_BYTES or not hmac.compare_digest(expected, self._tag(payload)):
            raise InvalidRequest(f"Invalid `signature` in `{param}`", param=param)
        return zlib.decompress(payload).decode()

    def check(self, token: str | None, text: str, param: str) -> str:
        """The reasoning text to use for a block sent back with ``token``.

        Args:
            token: its signature or ``encrypted_content``.
            text: the reasoning text the client sent with it (may be empty: omitted display).
            param: where the block sits, for the error.

        Returns:
            The signed text for a sluice token (restoring omitted text), else ``text``.

        Raises:
            InvalidRequest: a sluice token that does not verify, or text that differs from
                what it signed (the block was edited).
        """
        signed = self.open(token, param)
        if signed is None:
            return text
        if text and text != signed:
            raise InvalidRequest(
                f"`{param}` was modified: its text does not match its signature", param=param
            )
        return signed
