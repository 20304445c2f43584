"""Run a real sluice worker in-process for integration tests.

``running_worker`` starts the same worker ``sluice worker`` runs (arq on the model's queue,
heartbeat, lease refresher, recovery sweeper) as tasks on the test's event loop::

    async with running_worker(redis_url, "scripted:reasoning?rate=0") as worker:
        worker.name   # the model id to put in requests ("scripted-reasoning" unless name=...)
        worker.wid    # the worker id (heartbeat hash sluice:worker:{wid})
        await worker.kill()   # hard kill, as SIGKILL: no terminal events, leases left to expire
    # leaving the block stops it cleanly (in-flight requests get a terminal event)

``model_spec`` is any ``--model`` value (``scripted:<scenario>[?rate=<tok/s>&max_batch=<n>]`` for
the test double). ``settings_overrides`` are ``Settings`` fields over the harness defaults (a
half-second beat and a 3 s lease, calm enough for a loaded CI box); failover tests pass
``FAST_FAILOVER`` to be continued within about a second. The signature is relied on by the API
and wire-format tests: extend it only with keyword arguments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.worker.backend import Backend
from services.worker.main import RunningWorker, load_backend, start_worker
from shared.config import Settings

__all__ = ["FAST_FAILOVER", "TEST_DEFAULTS", "WorkerHandle", "running_worker"]

TEST_DEFAULTS: dict[str, object] = {"heartbeat_s": 0.5, "lease_ttl_s": 3.0, "poll_delay_s": 0.01}
FAST_FAILOVER: dict[str, object] = {"heartbeat_s": 0.1, "lease_ttl_s": 1.0}


@dataclass
class WorkerHandle:
    """A worker started by ``running_worker``."""

    running: RunningWorker
    settings: Settings
    backend: Backend

    @property
    def name(self) -> str:
        """The model id this worker serves (its queue is ``sluice:queue:{name}``)."""
        return self.running.name

    @property
    def wid(self) -> str:
        """The worker id."""
        return self.running.wid

    async def stop(self, grace_s: float = 0.5) -> None:
        """Clean stop: running requests get ``grace_s`` to finish, then a terminal event."""
        await self.running.stop(grace_s)

    async def kill(self) -> None:
        """Hard kill: nothing more is published; leases expire and a peer takes over."""
        await self.running.kill()


@asynccontextmanager
async def running_worker(
    redis_url: str,
    model_spec: str = "scripted:text?rate=0",
    settings_overrides: Mapping[str, object] | None = None,
    name: str | None = None,
    *,
    wid: str | None = None,
) -> AsyncIterator[WorkerHandle]:
    """Start a worker serving ``model_spec`` against ``redis_url``; stop it on exit."""
    overrides = {**TEST_DEFAULTS, **(settings_overrides or {}), "redis_url": redis_url}
    settings = Settings.from_env({}, **overrides)
    backend = load_backend(settings, model_spec, name)
    handle = WorkerHandle(await start_worker(settings, backend, wid=wid), settings, backend)
    try:
        yield handle
    finally:
        await handle.stop()
