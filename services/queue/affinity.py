"""Cache-aware pickup: a job goes first to the worker that holds the longest part of its prompt.

Pull-based, with no router to fail. Three pieces, all on the queue Redis:

- **Holdings** (worker): each worker publishes, cheaply and with expiry, the hashes of the KV
  blocks its prefix cache holds (``shared.prefix``, the chain the cache keys on) in a set of its
  own, and its free job slots and running jobs in the model's holders hash. Only changes travel
  (the block pool's journal, a few hashes per decode step); one call refreshes the expiry every
  ``REFRESH_S``, and a set that went missing (Redis restarted, the key expired while the worker
  was stalled) is re-sent whole.
- **Preference** (API, in the enqueue script): the job's prompt chain is matched against every
  live worker's set (``SMISMEMBER``, first miss ends it); the worker with the longest match wins,
  ties to the one with more free slots, then at random. Only workers with a free slot compete,
  a worker far busier than the least busy one is passed over (SGLang's balance guard), and one
  of the winner's slots is reserved until it next publishes, so a burst of sessions spreads
  over the workers instead of all preferring the first. The job records
  ``"<worker> <deadline> <blocks>"``, the deadline ``SLUICE_AFFINITY_WAIT_MS`` after enqueue
  on Redis's clock (no skew between hosts).
- **Claims** (worker, each poll): of the ids arq read, a worker starts those it is preferred
  for, those without a preference, those past their deadline, and those whose preferred worker
  has no free slot or stopped publishing (dead or gone): no job waits on a dead or busy worker
  longer than the wait, and usually not at all. The rest are left to their worker, and this one
  polls again at the earliest deadline. Ids another worker already runs are dropped here too, so
  arq does not re-check them in a transaction each.

Each started job counts one outcome: ``hit`` (its preferred worker, which held part of the
prompt, took it), ``miss`` (no worker held a block of it), ``after_wait`` (another worker took it
once the wait was over) or ``busy`` (another took it at once: the preferred one was full or gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from services.queue import arq_keys
from shared import keys

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["OUTCOMES", "PREFER", "Claims", "Holdings", "prefer_args"]

log = logging.getLogger(__name__)

OUTCOMES = ("hit", "miss", "after_wait", "busy")
HOLD_TTL_S = 3.0  # a worker silent this long no longer holds anything, nor is waited for
REFRESH_S = 0.5  # an idle worker re-publishes this often (its expiry), well inside the TTL
MIN_GAP_S = 0.01  # publishes closer than this are folded into one (a burst of job starts)
# How soon blocks a step registered are published: the decode thread cannot wake the event loop
# without a cross-thread call per step, so the loop looks at the journal this often. A session's
# next turn needs its previous prompt's blocks, known since that prompt was read, long before.
JOURNAL_EVERY_S = 0.02

# The scripts send hashes 256 to a Redis command: Lua's unpack has a stack limit (~8,000).
# Lua helpers: Redis's clock in ms, and a holder's "<free> <expiry ms> <reserved> <running>"
# field (reserved: jobs preferred to it since it last published, which it has not started yet).
_LUA_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function holder(field)
  if not field then return nil, nil, nil, nil end
  local free, expiry, reserved, running = string.match(field, '^(%-?%d+) (%d+) (%d+) (%d+)$')
  return tonumber(free), tonumber(expiry), tonumber(reserved), tonumber(running)
end
"""

# Runs inside the enqueue script, after the job is queued. KEYS[4]: the model's holders hash,
# KEYS[5]: the job's preference key. ARGV[6]: wait ms, ARGV[7]: a random salt (ties),
# ARGV[8]: the block-set key prefix (``keys.affinity_blocks("")``), ARGV[9..]: the chain.
# SGLang's balance guard, in jobs: a worker running (or promised) more than 2 jobs beyond the
# least busy candidate, and over 1.5 times its count, is passed over whatever it holds. Without
# it, sessions that start together all prefer whichever worker happened to be a chunk ahead in
# reading their shared system prompt (measured: 11 of 16 sessions on one of two workers).
PREFER = (
    _LUA_COMMON
    + """
local now, cands = now_ms(), {}
local holders = redis.call('HGETALL', KEYS[4])
for i = 1, #holders, 2 do
  local wid = holders[i]
  local free, expiry, reserved, running = holder(holders[i + 1])
  if not expiry or expiry <= now then
    redis.call('HDEL', KEYS[4], wid)
  elseif free - reserved > 0 then
    local n, from = 0, 9
    while from <= #ARGV do
      local to = math.min(from + 256 - 1, #ARGV)
      local held = redis.call('SMISMEMBER', ARGV[8] .. wid, unpack(ARGV, from, to))
      local k = 1
      while k <= #held and held[k] == 1 do k = k + 1 end
      n = n + k - 1
      if k <= #held then break end
      from = to + 1
    end
    cands[#cands + 1] = {wid = wid, n = n, free = free, expiry = expiry, reserved = reserved,
                         running = running, load = running + reserved, room = free - reserved}
  end
end
if #cands > 0 then
  local least = cands[1].load
  for _, c in ipairs(cands) do least = math.min(least, c.load) end
  local best, ties = nil, {}
  for _, c in ipairs(cands) do
    if not (c.load - least > 2 and c.load > 1.5 * least) then
      if not best or c.n > best.n or (c.n == best.n and c.room > best.room) then
        best, ties = c, {c}
      elseif c.n == best.n and c.room == best.room then
        ties[#ties + 1] = c
      end
    end
  end
  local c = ties[tonumber(ARGV[7]) % #ties + 1]
  local pref = c.wid .. ' ' .. (now + tonumber(ARGV[6])) .. ' ' .. c.n
  redis.call('SET', KEYS[5], pref, 'PX', ARGV[4])
  local field = c.free .. ' ' .. c.expiry .. ' ' .. (c.reserved + 1) .. ' ' .. c.running
  redis.call('HSET', KEYS[4], c.wid, field)
end
"""
)

# A worker's poll: which of the ids read it may start now. KEYS[1]: the holders hash. ARGV[1]:
# this worker, ARGV[2]: arq's in-progress key prefix, ARGV[3]: the preference key prefix,
# ARGV[4..]: job ids. Returns {ms until the earliest deadline left to another worker (-1: none),
# {id, outcome, id, outcome, ...}}.
_CLAIMABLE = (
    _LUA_COMMON
    + """
local now, soonest, out = now_ms(), -1, {}
for i = 4, #ARGV do
  local jid = ARGV[i]
  if redis.call('EXISTS', ARGV[2] .. jid) == 0 then
    local pref, outcome = redis.call('GET', ARGV[3] .. jid), nil
    if not pref then
      outcome = 'miss'
    else
      local wid, deadline, n = string.match(pref, '^(.*) (%d+) (%d+)$')
      deadline, n = tonumber(deadline), tonumber(n)
      local cached = n > 0  -- else preferred only to spread the load
      if wid == ARGV[1] then
        outcome = cached and 'hit' or 'miss'
      elseif now >= deadline then
        outcome = cached and 'after_wait' or 'miss'
      else
        local free, expiry = holder(redis.call('HGET', KEYS[1], wid))
        if not expiry or expiry <= now or free <= 0 then outcome = cached and 'busy' or 'miss' end
      end
      if not outcome and (soonest < 0 or deadline - now < soonest) then
        soonest = deadline - now
      end
    end
    if outcome then
      out[#out + 1] = jid
      out[#out + 1] = outcome
    end
  end
end
return {soonest, out}
"""
)

# A worker's holdings, changes only. KEYS[1]: the holders hash, KEYS[2]: this worker's block
# set. ARGV[1]: worker id, ARGV[2]: "<free slots> <running jobs>", ARGV[3]: TTL ms, ARGV[4]:
# '1' to replace the set, ARGV[5]: how many hashes to add, then those, then the hashes to
# remove. Returns the set's size, which the worker compares with its own count to notice a set
# that went missing.
_HOLD = (
    _LUA_COMMON
    + """
if ARGV[4] == '1' then redis.call('DEL', KEYS[2]) end
local adds = tonumber(ARGV[5])
local function apply(cmd, from, to)
  while from <= to do
    local upto = math.min(from + 256 - 1, to)
    redis.call(cmd, KEYS[2], unpack(ARGV, from, upto))
    from = upto + 1
  end
end
apply('SADD', 6, 5 + adds)
apply('SREM', 6 + adds, #ARGV)
local ttl = tonumber(ARGV[3])
redis.call('PEXPIRE', KEYS[2], ttl)
local free, running = string.match(ARGV[2], '^(%-?%d+) (%d+)$')
redis.call('HSET', KEYS[1], ARGV[1], free .. ' ' .. (now_ms() + ttl) .. ' 0 ' .. running)
redis.call('PEXPIRE', KEYS[1], ttl)
return redis.call('SCARD', KEYS[2])
"""
)


def prefer_args(
    model: str, job_id: str, chain: list[bytes], wait_ms: int
) -> tuple[list[str], list[Any]]:
    """The extra KEYS and ARGV of the enqueue script's ``PREFER`` part for one job."""
    keys_ = [keys.affinity_holders(model), keys.affinity_preference(job_id)]
    args: list[Any] = [wait_ms, random.getrandbits(30), keys.affinity_blocks(""), *chain]
    return keys_, args


class Claims:
    """The pickup filter of one worker's polls."""

    def __init__(self, redis: aioredis.Redis, model: str, wid: str) -> None:
        """``wid``: this worker, as its holdings name it."""
        self.wid = wid
        self._holders = keys.affinity_holders(model)
        self._script = redis.register_script(_CLAIMABLE)
        self._prefixes = [arq_keys.in_progress(""), keys.affinity_preference("")]

    async def claimable(self, job_ids: list[str]) -> tuple[dict[str, str], float | None]:
        """Which of ``job_ids`` this worker may start now, each with its outcome, and the
        seconds until the earliest deadline of one left to another worker (None: none)."""
        if not job_ids:
            return {}, None
        soonest, flat = await self._script([self._holders], [self.wid, *self._prefixes, *job_ids])
        taken = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
        return taken, None if int(soonest) < 0 else int(soonest) / 1000


class Holdings:
    """What one worker publishes: the prefix blocks it holds and its free job slots."""

    def __init__(
        self,
        redis: aioredis.Redis,
        model: str,
        wid: str,
        slots: Callable[[], tuple[int, int]],
        journal: deque[tuple[bool, bytes]] | None,
        ttl_s: float = HOLD_TTL_S,
    ) -> None:
        """``slots``: (the job slots this worker would fill now, the jobs it runs); ``journal``:
        the block pool's record of known blocks (None: a backend without a prefix cache
        publishes slots only)."""
        self.wid, self.slots, self.journal, self.ttl_s = wid, slots, journal, ttl_s
        self.held: set[bytes] = set()
        self.publishes = 0
        self._keys = [keys.affinity_holders(model), keys.affinity_blocks(wid)]
        self._script = redis.register_script(_HOLD)
        self._redis = redis
        self._due = asyncio.Event()
        self._due.set()  # the first publish at once: a new worker can be preferred
        self._resend = False

    def changed(self) -> None:
        """Publish soon: free slots changed (a job started or ended)."""
        self._due.set()

    def _drain(self) -> tuple[list[bytes], list[bytes]]:
        net: dict[bytes, bool] = {}
        journal = self.journal
        while journal:
            known, h = journal.popleft()
            net[h] = known
            (self.held.add if known else self.held.discard)(h)
        if self._resend:
            return list(self.held), []
        return [h for h, k in net.items() if k], [h for h, k in net.items() if not k]

    async def publish(self) -> None:
        """One call: the changes since the last publish (or everything, after a loss)."""
        adds, removes = self._drain()
        resend = self._resend
        args: list[Any] = [
            self.wid, " ".join(map(str, self.slots())), int(self.ttl_s * 1000),
            "1" if resend else "0", len(adds), *adds, *removes,
        ]  # fmt: skip
        self._resend = True  # until this call is known to have landed
        size = int(await self._script(self._keys, args))
        self._resend = size != len(self.held)
        if self._resend and not resend:
            log.info("prefix holdings lost in Redis (%d of %d); sending all", size, len(self.held))
        self.publishes += 1

    async def run(self) -> None:
        """Publish when slots change, within ``JOURNAL_EVERY_S`` of blocks becoming known or
        evicted, and every ``REFRESH_S`` regardless, until cancelled."""
        loop = asyncio.get_running_loop()
        refresh_at = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(JOURNAL_EVERY_S):
                    await self._due.wait()
            if not (self._due.is_set() or self.journal or loop.time() >= refresh_at):
                continue
            self._due.clear()
            try:
                await self.publish()
            except (RedisError, OSError) as exc:  # the poll's backoff reports the outage
                log.debug("publishing prefix holdings failed: %s", exc)
                await asyncio.sleep(REFRESH_S)
            refresh_at = loop.time() + REFRESH_S
            await asyncio.sleep(MIN_GAP_S)

    async def retire(self) -> None:
        """A clean stop: hold nothing, be preferred for nothing."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hdel(self._keys[0], self.wid)
            pipe.delete(self._keys[1])
            await pipe.execute()
