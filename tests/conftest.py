"""Fixtures shared by every test layer.

Integration tests talk to a real Redis: ``SLUICE_TEST_REDIS_URL`` (default database 15 of the
local server, so a developer's data in database 0 is never flushed), flushed before each test.

Without a GPU, Triton kernels (the GPU engine's paged attention) run in Triton's interpreter on
CPU tensors: set before anything imports triton, which reads it when a kernel is defined.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a scalar loaded at run time into a one-element array, and
    ``range`` over it calls ``int()`` of that array, which NumPy 2.4 refuses; the compiled
    kernel has no such step. Index through the array's single element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: object) -> None:
        patch(tensor, scope)
        scope.set_attr(  # type: ignore[attr-defined]
            tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
        )

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_loop_bounds()

TEST_REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def redis_url() -> str:
    """The Redis URL integration tests use (a dedicated database)."""
    return TEST_REDIS_URL


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A real Redis connection on a freshly flushed database."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.ping()
    except Exception as exc:  # a missing server is a setup error, not a skip
        pytest.fail(f"no Redis at {redis_url}: {exc}")
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()
