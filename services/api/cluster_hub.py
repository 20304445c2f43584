"""The stream hub on a Redis Cluster: per node, a doorbell subscription and batched reads.

On one Redis the hub blocks in one XREAD over every stream (``services.api.hub``). A cluster
refuses that: the streams of different requests live in different slots, and a command whose
keys span slots fails with CROSSSLOT, even on one node. So each node the hub reads from gets

- a doorbell connection: ``SSUBSCRIBE`` to the shard channel of each stream it serves (channel
  name = stream key, so it lives in the stream's slot). The scripts that append events ring it
  (``shared.protocol.DOORBELL``) with the id of the newest entry;
- a command connection on which the streams that rang are read with one pipelined round trip of
  single-key, non-blocking XREADs from each stream's cursor.

A stream is read right after its subscription is confirmed (nothing appended before it is
missed), after each ring, when a paused subscriber resumes or a new one joins, and every
``block_ms`` for all streams (a safety net: a ring lost with a connection costs at most that).

Reads go to a replica of the slot's primary when there is one (``READONLY``). With asynchronous
replication a primary that dies can take its last writes with it; reading from the replica that
will be promoted means the hub only ever hands out entries the promoted node has too, so a
continuation that regenerates the lost tail (the worker's recovery) never shows a client the
same text twice. A ring can overtake the replication stream (it travels on the cluster bus), so
a stream whose reply stops short of the rung id is read again a moment later.

Failover and resharding: a connection error, MOVED or CLUSTERDOWN on either connection refreshes
the topology, rebuilds the node readers and reads every stream again from its cursor: a client
sees a pause, never a gap or a repeat, and no stream ends because of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from services.api.hub import StreamHub, Subscription
from services.api.stream_ids import StreamId, parse_id
from services.api.xread_wire import raw_reply

__all__ = ["ClusterStreamHub"]

logger = logging.getLogger(__name__)

_TOPOLOGY = (MovedError, AskError, ClusterDownError, TryAgainError)
LAG_RETRY_S = 0.002  # a replica behind a ring it already delivered: read again this soon
LAG_GIVE_UP_S = 1.0  # a ring whose entry never shows (lost in a failover): the safety net's


_TOPOLOGY_REPLIES = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN")  # as a plain client sees them


class _Topology(Exception):
    """A node's answer says the slot map changed (or a node is gone): resynchronise."""


def _is_topology(exc: BaseException) -> bool:
    return isinstance(exc, _TOPOLOGY) or str(exc).startswith(_TOPOLOGY_REPLIES)


class _ReadOnlyConnection(Connection):
    """A connection that may read a replica's keys: READONLY on every (re)connect."""

    async def on_connect(self) -> None:
        await super().on_connect()
        await self.send_command("READONLY")  # harmless on a primary
        await self.read_response()


class _NodeReader:
    """One node's doorbell listener and command connection."""

    def __init__(self, hub: ClusterStreamHub, host: str, port: int) -> None:
        self.hub = hub
        self.name = f"{host}:{port}"
        self.keys: set[str] = set()  # channels subscribed (or being subscribed) here
        self.dirty: set[str] = set()  # streams to read on the next pass
        # the newest id a ring announced, per stream, and until when to keep looking for it
        self.rung: dict[str, tuple[StreamId, float]] = {}
        self.failure: BaseException | None = None
        timeout = hub.block_ms / 1000 + 10
        pool = ConnectionPool(connection_class=_ReadOnlyConnection, host=host, port=port,
                              socket_timeout=timeout, socket_connect_timeout=5)  # fmt: skip
        self.conn = Redis(connection_pool=pool)
        self.conn.set_response_callback("XREAD", raw_reply)
        self.bell = _ReadOnlyConnection(host=host, port=port, socket_connect_timeout=5)
        self._listener: asyncio.Task[None] | None = None

    async def open(self) -> None:
        await self.conn.ping()  # fail here, not in the first read
        await self.bell.connect()  # type: ignore[no-untyped-call]
        self._listener = asyncio.create_task(self._listen(), name=f"sluice-hub-{self.name}")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.bell.disconnect()
        with contextlib.suppress(Exception):
            await self.conn.aclose(close_connection_pool=True)

    async def subscribe(self, key: str) -> None:
        self.keys.add(key)
        await self.bell.send_command("SSUBSCRIBE", key)  # read once confirmed (_listen)

    async def unsubscribe(self, key: str) -> None:
        self.keys.discard(key)
        self.dirty.discard(key)
        self.rung.pop(key, None)
        await self.bell.send_command("SUNSUBSCRIBE", key)

    async def _listen(self) -> None:
        try:
            while True:
                try:
                    reply = await self.bell.read_response()
                except ResponseError as exc:  # a slot moved away under a SSUBSCRIBE
                    if _is_topology(exc):
                        raise _Topology(str(exc)) from exc
                    raise
                kind, channel, payload = reply[0], reply[1].decode(), reply[2]
                if kind == b"smessage":
                    rung = parse_id(payload.decode())
                    if channel not in self.rung or rung > self.rung[channel][0]:
                        until = asyncio.get_running_loop().time() + LAG_GIVE_UP_S
                        self.rung[channel] = (rung, until)
                    self.dirty.add(channel)
                elif kind == b"ssubscribe":
                    self.dirty.add(channel)
                elif kind == b"sunsubscribe" and channel in self.keys:
                    raise _Topology(f"{self.name} dropped {channel} (its slot moved)")
                self.hub._changed.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # boundary: the hub resynchronises on the recorded failure
            self.failure = exc
            self.hub._changed.set()

    async def read(self, streams: dict[str, str], count: int) -> list[Any]:
        """One round trip: a single-key XREAD per stream (replies in order, errors inline)."""
        async with self.conn.pipeline(transaction=False) as pipe:
            for key, cursor in streams.items():
                pipe.xread({key: cursor}, count=count)
            return await pipe.execute(raise_on_error=False)


class ClusterStreamHub(StreamHub):
    """``StreamHub``'s interface over a Redis Cluster (``commands`` is a ``RedisCluster``)."""

    def __init__(self, redis_url: str, commands: Any, **options: Any) -> None:
        """Like ``StreamHub``; ``commands`` is the app's cluster client (topology source)."""
        super().__init__(redis_url, commands, **options)
        self._cluster = cast(RedisCluster, commands)
        self._readers: dict[str, _NodeReader] = {}
        self._where: dict[str, _NodeReader] = {}  # stream key -> the reader serving it
        self._seen: dict[str, tuple[int, ...]] = {}  # key -> ids of its unpaused subscribers
        self._changed = asyncio.Event()
        self.resyncs = 0

    async def start(self) -> None:
        """Learn the topology and start the supervisor task."""
        await self._cluster.initialize()
        self._task = asyncio.create_task(self._run(), name="sluice-cluster-hub")

    async def stop(self) -> None:
        """Stop reading and wake every subscriber with ``HubClosed``."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._drop_readers()
        for subs in self._subs.values():
            for sub in subs:
                sub._close()
        self._subs.clear()

    async def wake(self) -> None:
        """A subscription joined or resumed: have the supervisor look (no Redis call)."""
        self._version += 1
        self._changed.set()

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to ``sub``; its channel is released on the next pass."""
        super().unsubscribe(sub)
        self._changed.set()

    def _reader_for(self, key: str) -> tuple[str, int]:
        nodes = self._cluster.nodes_manager.slots_cache[self._cluster.keyslot(key)]
        node = nodes[1] if len(nodes) > 1 else nodes[0]  # a replica: what survives a failover
        return node.host, int(node.port)

    async def _sync(self) -> None:
        """Move subscriptions onto their nodes' readers; mark new or resumed streams dirty."""
        for key in [k for k in self._where if k not in self._subs]:
            self._seen.pop(key, None)
            await self._where.pop(key).unsubscribe(key)
        # A snapshot: the awaits below (a new node's reader, SSUBSCRIBE) let clients subscribe
        # meanwhile, and iterating the live map would die mid-pass (and with it the hub task);
        # a stream that joins now is taken on the next pass, which its wake() asks for.
        for key, subs in list(self._subs.items()):
            if key not in self._subs:
                continue  # unsubscribed during an await of this pass
            host, port = self._reader_for(key)
            name = f"{host}:{port}"
            reader: _NodeReader | None = self._where.get(key)
            if reader is not None and reader.name != name:  # the slot's node changed
                await reader.unsubscribe(key)
                reader = None
            if reader is None:
                reader = self._readers.get(name)
                if reader is None:
                    reader = self._readers[name] = _NodeReader(self, host, port)
                    await reader.open()
                self._where[key] = reader
                await reader.subscribe(key)
            live = tuple(id(s) for s in subs if not s.paused)
            if live and not set(live) <= set(self._seen.get(key, ())):
                reader.dirty.add(key)  # a subscriber joined or resumed: catch it up
            self._seen[key] = live

    async def _read_dirty(self) -> bool:
        """Read every dirty stream; True when some must be read again soon (replica lag)."""
        again = False
        for reader in list(self._readers.values()):
            if reader.failure is not None:
                raise reader.failure
            streams = self._cursors(reader.dirty & reader.keys)
            reader.dirty.clear()
            if not streams:
                continue
            replies = await reader.read(streams, self.count)
            self.xread_calls += 1
            got = 0
            for (key, _), reply in zip(streams.items(), replies, strict=True):
                if isinstance(reply, Exception) and _is_topology(reply):
                    raise _Topology(str(reply))
                if isinstance(reply, ResponseError):
                    self._fail(key, reply)
                    continue
                if isinstance(reply, Exception):
                    raise reply
                if reply:
                    self._dispatch(reply)
                    got += len(reply[0][1])
                    if len(reply[0][1]) >= self.count:
                        reader.dirty.add(key)  # more where these came from
                if self._behind(key, reader):
                    reader.dirty.add(key)
                    again = True
            if got:
                self.on_read(got)
        return again

    def _cursors(self, keys: set[str]) -> dict[str, str]:
        streams: dict[str, str] = {}
        for key in keys:
            best = None
            for sub in self._subs.get(key, ()):
                if not sub.paused and (best is None or sub.cursor_id < best.cursor_id):
                    best = sub
            if best is not None:
                streams[key] = best.cursor
        return streams

    def _behind(self, key: str, reader: _NodeReader) -> bool:
        ring = reader.rung.get(key)
        if ring is None:
            return False
        rung, until = ring
        subs = [s for s in self._subs.get(key, ()) if not s.paused]
        now = asyncio.get_running_loop().time()
        if subs and min(s.cursor_id for s in subs) < rung and now < until:
            return True
        reader.rung.pop(key, None)
        return False

    async def _drop_readers(self) -> None:
        readers, self._readers, self._where, self._seen = self._readers, {}, {}, {}
        await asyncio.gather(*(r.close() for r in readers.values()), return_exceptions=True)

    async def _resync(self) -> None:
        """Forget the readers and the slot map; every stream is read again from its cursor."""
        self.resyncs += 1
        await self._drop_readers()
        await self._cluster.nodes_manager.initialize()

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stopping:
            self._changed.clear()
            try:
                await self._sync()
                again = await self._read_dirty()
            except Exception as exc:  # boundary: if this task died, every stream would hang
                if isinstance(exc, RedisError | OSError | _Topology):
                    logger.warning("cluster hub: %s; resynchronising in %.2fs", exc, backoff)
                else:
                    logger.exception("cluster hub failed; resynchronising in %.2fs", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                with contextlib.suppress(RedisError, OSError):
                    await self._resync()
                continue
            backoff = 0.05
            timeout = LAG_RETRY_S if again else self.block_ms / 1000
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                if not again:  # the safety net: read every stream now and then
                    for reader in self._readers.values():
                        reader.dirty |= reader.keys
