"""Settings from ``SLUICE_*`` environment variables, read once by each process entry point.

Nothing here reads the environment at import time; call ``Settings.from_env()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import msgspec

__all__ = ["Settings"]


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Every tunable of the API and the worker, with its environment variable in the comment."""

    redis_url: str = "redis://127.0.0.1:6379/0"  # SLUICE_REDIS_URL
    # SLUICE_EVENTS_URL: event logs, request state, leases, stored responses, cards, heartbeats;
    # SLUICE_QUEUE_URL: arq's queues (arq needs one Redis). Empty = SLUICE_REDIS_URL, so a
    # single Redis needs neither; two let the hot event traffic move off the queue's server.
    events_url: str = ""
    queue_url: str = ""
    host: str = "127.0.0.1"  # SLUICE_HOST
    port: int = 8000  # SLUICE_PORT
    api_keys: list[str] = []  # SLUICE_API_KEYS (comma-separated); empty = auth off
    api_keys_file: str | None = None  # SLUICE_API_KEYS_FILE (one key per line)
    api_key: str | None = None  # SLUICE_API_KEY: the key `sluice replay` sends
    # SLUICE_OWNER_SECRET: HMAC key of stored owner ids; unset = one generated once, kept in Redis
    owner_secret: str | None = None
    # SLUICE_METRICS_KEY: the bearer token the API's GET /metrics requires; unset = any API key
    # when SLUICE_API_KEYS is set, else /metrics is open
    metrics_key: str | None = None
    model: str = "smollm2"  # SLUICE_MODEL: what `sluice worker` serves by default
    model_name: str | None = None  # SLUICE_MODEL_NAME: the public id (default: derived)
    retention_s: int = 86_400  # SLUICE_RETENTION_S: TTL of event streams and request hashes
    # SLUICE_UNSTORED_RETENTION_S: how long a `store: false` request's log and hash outlive its
    # terminal event (the window in which a dropped client can still resume it).
    unstored_retention_s: int = 60
    stream_maxlen: int = 100_000  # SLUICE_STREAM_MAXLEN: cap on entries per event stream
    queue_max: int = 1024  # SLUICE_QUEUE_MAX: queued jobs per model before 429
    # SLUICE_MAX_N: the most choices (``n``) one Chat or Completions request may ask for; each is
    # a job, so a request takes n places of SLUICE_QUEUE_MAX
    max_n: int = 8
    job_expires_s: int = 120  # SLUICE_JOB_EXPIRES_S: a job not started by then is dropped
    poll_delay_s: float = 0.01  # SLUICE_POLL_DELAY_S: arq poll interval (pickup latency)
    # SLUICE_IDLE_POLL_S: workers poll their queue when a job is queued (its doorbell rings) and
    # at least this often; 0: every SLUICE_POLL_DELAY_S, as plain arq
    idle_poll_s: float = 1.0
    # SLUICE_AFFINITY_WAIT_MS: cache-aware pickup across workers: a job is first the worker's
    # that holds the longest prefix of its prompt, anyone's after this long (at once when that
    # worker has no free slot or is gone). 0 = off: the first worker to poll takes it.
    affinity_wait_ms: int = 50
    # SLUICE_MAX_BATCH: running sequences per worker, a cap beside the KV pool's blocks (0 = 64
    # on the CPU, 256 on a GPU)
    max_batch: int = 0
    # SLUICE_STREAM_INTERVAL_S: the least time between two publishes of one request; the
    # steps in between go out together (0: every step as its own entry)
    stream_interval_s: float = 0.02
    lease_ttl_s: float = 5.0  # SLUICE_LEASE_TTL_S: a worker silent this long is presumed dead
    heartbeat_s: float = 1.0  # SLUICE_HEARTBEAT_S: lease/heartbeat refresh period
    max_attempts: int = 3  # SLUICE_MAX_ATTEMPTS: worker deaths tolerated per request
    # SLUICE_OOM_WAIT_S: how long a worker holds a running request's events and retries while
    # Redis refuses writes (maxmemory reached) before it ends the request with a retryable error
    oom_wait_s: float = 60.0
    keepalive_s: float = 10.0  # SLUICE_KEEPALIVE_S: SSE comment when nothing else was sent
    start_timeout_s: float = 600.0  # SLUICE_START_TIMEOUT_S: give up if no worker starts it
    max_body_bytes: int = 8 * 1024 * 1024  # SLUICE_MAX_BODY_BYTES: larger requests get 413
    reasoning_when_hidden: bool = False  # SLUICE_REASONING_WHEN_HIDDEN: think if unseen?
    chat_reasoning_field: Literal["reasoning_content", "reasoning", "both"] = (
        "reasoning_content"  # SLUICE_CHAT_REASONING_FIELD
    )
    # SLUICE_REASONING_SECRET: the HMAC secret of thinking signatures and Responses
    # encrypted_content, shared by every API replica; empty = one generated once, kept in Redis.
    reasoning_secret: str = ""
    device: str = "auto"  # SLUICE_DEVICE: auto | cpu | cuda
    dtype: str = "auto"  # SLUICE_DTYPE: auto | float32 | bfloat16 | float16 | int4
    cpu_kernels: bool = True  # SLUICE_CPU_KERNELS: 4-bit CPU models on sluice's C kernels
    kernel_dir: str | None = None  # SLUICE_KERNEL_DIR: kernel build cache (~/.cache/sluice/kernels)
    # SLUICE_THREADS: CPU threads (0 = torch's default): a model on the CPU kernels runs its
    # forwards on them and leaves torch one thread; a model torch runs gives them to torch
    threads: int = 0
    # SLUICE_PREFILL_THREADS: the CPU kernels' threads for a prompt chunk (0 = SLUICE_THREADS).
    # More than SLUICE_THREADS pays where the API shares the cores: it idles while a prompt is read.
    prefill_threads: int = 0
    log_level: str = "info"  # SLUICE_LOG_LEVEL
    log_format: Literal["text", "json"] = "text"  # SLUICE_LOG_FORMAT: one line per event
    log_content: bool = False  # SLUICE_LOG_CONTENT: may logs carry prompt and output text?
    # SLUICE_METRICS_PORT: a worker serves Prometheus metrics on http://SLUICE_HOST:port/metrics
    # (0 = off; the API always serves GET /metrics on its own port).
    metrics_port: int = 0
    # SLUICE_KV_CACHE_BYTES: the paged KV cache's pool, shared by running sequences and the
    # prefix cache (0 = 15 % of physical memory up to 8 GiB on the CPU; on a GPU what
    # SLUICE_GPU_MEMORY_UTILIZATION leaves once the model is loaded); reserved, not touched until
    # blocks fill.
    kv_cache_bytes: int = 0
    # SLUICE_GPU_MEMORY_UTILIZATION: the share of the GPU's memory this worker may hold in all
    # (weights, KV pool, graphs, activations); the rest stays free for other processes.
    gpu_memory_utilization: float = 0.9
    # SLUICE_CUDA_GRAPHS: replay decode steps from CUDA graphs captured at start-up, one per
    # batch-size bucket (false: launch every kernel eagerly, for debugging).
    cuda_graphs: bool = True
    # SLUICE_MAX_CACHED_TOKENS: the pool in tokens instead of bytes (0 = from the bytes).
    max_cached_tokens: int = 0
    kv_block_size: int = 16  # SLUICE_KV_BLOCK_SIZE: tokens per KV block (a multiple of 8)
    # SLUICE_MAX_BATCHED_TOKENS: new tokens one forward step computes: every decoding
    # sequence's next token, then prompt chunks in what is left (0 = 512 on the CPU, 2048 on
    # a GPU). Smaller keeps streams smooth while long prompts arrive; larger reads prompts
    # faster.
    max_batched_tokens: int = 0
    # SLUICE_PREFILL_STALL: a step that reads a prompt while streams decode takes at most about
    # this many times a decode-only step (measured as it runs): fewer prompt rows per step, so
    # each stream's next token is late by at most that much (0: the token budget alone).
    prefill_stall: float = 2.5
    # SLUICE_SPECULATIVE: prompt-lookup speculative decoding: a decoding sequence's continuation
    # of the latest earlier occurrence of its last tokens is verified in the same forward, and the
    # model's own tokens are kept (on the CPU kernels the output is unchanged bit for bit; on
    # torch, up to float ties). On by default: drafts are verified only where the batch gains by
    # them at the row cost measured on this worker, so a copy runs faster and fresh text about
    # as fast (docs/benchmarks.md, *Speculative decoding*).
    speculative: bool = True
    # SLUICE_SPECULATIVE_TOKENS: draft tokens verified per sequence and step (k).
    speculative_tokens: int = 4

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Build settings from ``SLUICE_*`` variables, then apply explicit overrides.

        Raises:
            msgspec.ValidationError: a variable does not parse as its field's type.
        """
        env = os.environ if env is None else env
        raw: dict[str, object] = {}
        for field in msgspec.structs.fields(cls):
            value = env.get(f"SLUICE_{field.name.upper()}")
            if value is None:
                continue
            if field.name == "api_keys":
                raw[field.name] = [k.strip() for k in value.split(",") if k.strip()]
            else:
                raw[field.name] = value
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return msgspec.convert(raw, cls, strict=False)

    @property
    def events_redis_url(self) -> str:
        """Where event logs and request state live (``SLUICE_EVENTS_URL``, else the Redis URL)."""
        return self.events_url or self.redis_url

    @property
    def queue_redis_url(self) -> str:
        """Where arq's queues live (``SLUICE_QUEUE_URL``, else the Redis URL)."""
        return self.queue_url or self.redis_url

    def all_api_keys(self) -> set[str]:
        """Keys from the variable and the keys file together (file read on each call)."""
        keys = set(self.api_keys)
        if self.api_keys_file:
            with open(self.api_keys_file, encoding="utf-8") as fh:
                keys |= {line.strip() for line in fh if line.strip() and not line.startswith("#")}
        return keys
