"""The torch ``Backend``: model loading at start-up and the asyncio face of the decode loop.

Owns ``TorchBackend``: ``TorchBackend.load`` turns settings + a model spec into a ready backend;
``generate`` takes the job's prompt ids (the API rendered and tokenized them), resolves the
sampling config and the seeded generator, submits a ``SequenceState`` to the ``Scheduler``
thread and relays its event batches, paced, from the request's ``handoff.Mailbox``. Closing the
iterator early cancels: its blocks are freed before ``aclose`` returns. Knows nothing about
Redis.

It also sizes the paged KV cache (``SLUICE_KV_CACHE_BYTES``, or ``SLUICE_MAX_CACHED_TOKENS``
tokens; by default a share of the machine's memory or of the GPU's free memory) and rejects,
with ``ContextOverflow``, a request whose prompt plus ``max_tokens`` could never fit in it (it
could never finish, even alone). A request without ``max_tokens`` may generate up to the context
or the pool, whichever is smaller.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable

import torch

from services.worker.constrain import Constrainer
from services.worker.handoff import Item, Mailbox, Outbox
from services.worker.kv_cache import PagedKVCache
from services.worker.loaders import LoadedModel, load_model
from services.worker.models.kernel_llama import QuantizedLlama
from services.worker.sampling import SamplingConfig
from services.worker.scheduler import Scheduler
from services.worker.sequence import DecoderFactory, DecoderLike, SequenceState
from shared.config import Settings
from shared.errors import ContextOverflow, InvalidRequest
from shared.events import AnyEvent, is_terminal
from shared.jobs import Job
from shared.model_card import ModelCard
from shared.prompt import starts_in_reasoning

__all__ = ["TorchBackend", "default_kv_bytes", "pool_blocks", "sampling_config"]

CPU_KV_SHARE, CPU_KV_CAP = 0.15, 8 * 1024**3  # of physical memory, at most 8 GiB
# GPU memory kept out of the KV pool for activations, the graphs' pool and allocator slack
GPU_RESERVE = 1024**3


def default_kv_bytes(
    device: torch.device, utilization: float = 0.9, reserve: int = GPU_RESERVE
) -> int:
    """The KV pool's default size (``SLUICE_KV_CACHE_BYTES`` = 0): on a GPU what the worker's
    share of the device (``utilization`` of its memory) leaves once the weights are loaded,
    less ``reserve``; on the CPU a share of the machine's memory. The pool is reserved, not
    touched: a CPU worker's resident memory grows only with the blocks it fills, a 2 MB page
    per layer and kv head at a time (``host_memory``: the default model's first block makes
    360 MB resident, and it grows by about that much every 8-16k tokens)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(total * utilization) - (total - free) - reserve)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 * 1024**3
    return min(int(total * CPU_KV_SHARE), CPU_KV_CAP)


def pool_blocks(
    *, kv_bytes: int, tokens: int, per_token: int, block_size: int, context: int
) -> int:
    """Blocks in the pool: ``tokens`` (``SLUICE_MAX_CACHED_TOKENS``) when set, else what
    ``kv_bytes`` holds at ``per_token`` bytes a token but at least one full context."""
    want = tokens or max(kv_bytes // per_token, context)
    return -(-want // block_size)


def sampling_config(job: Job, card: ModelCard) -> SamplingConfig:
    """Resolve a job's sampling knobs over the model's generation_config defaults."""
    s = job.sampling
    temperature = s.temperature if s.temperature is not None else card.default_temperature
    top_p = s.top_p if s.top_p is not None else card.default_top_p
    top_k = s.top_k if s.top_k is not None else card.default_top_k
    return SamplingConfig(
        temperature=1.0 if temperature is None else float(temperature),
        top_k=int(top_k or 0),
        top_p=1.0 if top_p is None else float(top_p),
        min_p=float(s.min_p or 0.0),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
    )


class TorchBackend:
    """Continuous-batching inference over one loaded model (implements ``Backend``)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch: int = 0,
        make_decoder: DecoderFactory | None = None,
        max_cached_tokens: int = 0,
        kv_cache_bytes: int = 0,
        block_size: int = 16,
        max_batched_tokens: int = 0,
        prefill_stall: float = 0.0,
        stream_interval_s: float = 0.0,
        gpu_memory_utilization: float = 0.9,
        cuda_graphs: bool = True,
        speculative_tokens: int = 0,
    ) -> None:
        """Wrap a loaded model; ``make_decoder`` defaults to the real ``OutputDecoder``.

        ``max_batch`` caps running sequences (0: 64 on the CPU, 256 on a GPU); the KV pool
        holds ``max_cached_tokens`` tokens when set, else ``kv_cache_bytes`` (0: derived,
        ``default_kv_bytes``) in blocks of ``block_size``; ``max_batched_tokens`` bounds the
        new tokens of one step (0: 512 on the CPU, 2048 on a GPU), ``prefill_stall`` how much
        longer than a decode step a step that also reads prompts may take (0: no bound);
        ``stream_interval_s`` is
        the least time between two batches of one request that ``generate`` yields (steps in
        between are joined; 0: each as soon as it is taken); ``gpu_memory_utilization`` the
        share of a GPU the worker may fill; ``cuda_graphs`` replays decode steps on a GPU;
        ``speculative_tokens`` > 0 verifies that many prompt-lookup draft tokens a step (CPU).
        """
        self.loaded = loaded
        self.stream_interval_s = stream_interval_s
        self._outbox: Outbox | None = None  # the decode thread's hand-off to the serving loop
        self.card: ModelCard = loaded.card
        gpu = loaded.device.type == "cuda"
        self.max_batch = max_batch or (256 if gpu else 64)
        cfg = loaded.model.config
        per_token = PagedKVCache.bytes_per_token(
            int(cfg.num_layers),
            int(cfg.num_kv_heads),
            int(cfg.head_dim),
            getattr(loaded.model, "kv_dtype", loaded.dtype),
        )
        # the graphs' logits buffers and the sampler's work on them, beside the fixed reserve
        reserve = GPU_RESERVE + 2 * self.max_batch * int(cfg.vocab_size) * 4
        blocks = pool_blocks(
            kv_bytes=kv_cache_bytes
            or default_kv_bytes(loaded.device, gpu_memory_utilization, reserve),
            tokens=max_cached_tokens,
            per_token=per_token,
            block_size=block_size,
            context=int(cfg.context_length),
        )
        if gpu and not (kv_cache_bytes or max_cached_tokens):
            # running sequences can never fill more than max_batch whole contexts: a small model
            # would otherwise take most of the card for a prefix cache it cannot use
            blocks = min(blocks, -(-self.max_batch * int(cfg.context_length) // block_size))
        self.constrainer = Constrainer(
            loaded.card.tokenizer_json,
            vocab=int(cfg.vocab_size),
            eos_ids=list(loaded.card.eos_token_ids),
            max_batch=self.max_batch,
        )
        self.scheduler = Scheduler(
            loaded.model,
            loaded.tokenizer,
            eos_ids=list(loaded.card.eos_token_ids),
            max_batch=self.max_batch,
            device=loaded.device,
            dtype=loaded.dtype,
            make_decoder=make_decoder or self._output_decoder,
            num_blocks=blocks,
            block_size=block_size,
            max_batched_tokens=max_batched_tokens or (2048 if gpu else 512),
            stall=prefill_stall,
            model_id=loaded.card.name,
            constrainer=self.constrainer,
            cuda_graphs=cuda_graphs,
            speculative_tokens=speculative_tokens,
        )

    def _output_decoder(
        self, job: Job, prompt_tokens: int, cached: int, in_reasoning: bool
    ) -> DecoderLike:
        from services.worker.parsing.decoder import OutputDecoder

        return OutputDecoder(
            tokenizer=self.loaded.tokenizer,
            card=self.card,
            job=job,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            starts_in_reasoning=in_reasoning,
        )

    @property
    def device(self) -> str:
        """The torch device the model runs on (the heartbeat and metrics name it)."""
        return str(self.loaded.device)

    async def start(self) -> None:
        """Start the decode loop thread."""
        self.scheduler.start()

    async def stop(self) -> None:
        """Stop the decode loop; in-flight iterators raise."""
        await asyncio.to_thread(self.scheduler.stop)

    def _sequence(
        self,
        job: Job,
        resume: list[int],
        attempt: int,
        emit: Callable[[list[AnyEvent] | BaseException], None],
        on_freed: Callable[[], None],
    ) -> SequenceState:
        """Validate the prompt and build the scheduler's sequence for ``job``."""
        prompt = list(job.prompt_token_ids)
        in_reasoning = starts_in_reasoning(prompt, self.card.reasoning)
        ctx, vocab = self.scheduler.context_length, self.scheduler.vocab
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if max(prompt) >= vocab or min(prompt) < 0:
            raise InvalidRequest("prompt token ids outside the model's vocabulary")
        if len(prompt) + len(resume) >= ctx:
            raise ContextOverflow(
                f"prompt of {len(prompt)} tokens leaves no room in the {ctx}-token context"
            )
        budget = self.scheduler.max_cached_tokens
        if len(prompt) + len(resume) >= budget:
            raise ContextOverflow(
                f"prompt of {len(prompt)} tokens leaves no room in this worker's "
                f"{budget}-token KV cache"
            )
        room = min(ctx, budget) - len(prompt)
        max_new = job.max_tokens if job.max_tokens is not None else room
        if max_new <= 0:
            raise InvalidRequest("max_tokens must be at least 1")
        if min(max_new, ctx - len(prompt)) > room:  # past the context is cut off, never cached
            raise ContextOverflow(
                f"prompt of {len(prompt)} tokens plus max_tokens={max_new} can never fit in "
                f"this worker's {budget}-token KV cache"
            )
        max_new = min(max_new, ctx - len(prompt))
        seq = SequenceState(
            job=job,
            prompt=prompt,
            resume=list(resume),
            attempt=attempt,
            starts_in_reasoning=in_reasoning,
            sampling=sampling_config(job, self.card),
            generator=(
                torch.Generator().manual_seed(job.sampling.seed)
                if job.sampling.seed is not None
                else None
            ),
            max_new=max_new,
            emit=emit,
            on_freed=on_freed,
        )
        if job.sampling.seed is not None:
            seq.seed = job.sampling.seed
        # penalty state where the token choice runs: the GPU's batched sampler, or the CPU
        where = self.loaded.device if self.scheduler.chooser.on_device else torch.device("cpu")
        if seq.sampling.presence_penalty or seq.sampling.frequency_penalty:
            seq.counts = torch.zeros(vocab, device=where)
        if seq.sampling.repetition_penalty != 1.0:
            seq.seen = torch.zeros(vocab, dtype=torch.bool, device=where)
            seq.seen[prompt] = True
        return seq

    async def generate(
        self, job: Job, resume_token_ids: list[int], attempt: int
    ) -> AsyncIterator[list[AnyEvent]]:
        """Yield the job's events step by step: Start, deltas, then Usage and Finish.

        Raises:
            InvalidRequest: empty prompt or token ids outside the vocabulary.
            ContextOverflow: the prompt leaves no room to generate.
        """
        loop = asyncio.get_running_loop()
        if self._outbox is None or self._outbox.loop is not loop:
            self._outbox = Outbox(loop)
        outbox, box = self._outbox, Mailbox(loop)
        freed = loop.create_future()

        def resolve_freed() -> None:
            if not freed.done():
                freed.set_result(None)

        def on_freed() -> None:
            loop.call_soon_threadsafe(resolve_freed)

        def emit(item: Item) -> None:
            outbox.put(box, item)

        seq = self._sequence(job, resume_token_ids, attempt, emit, on_freed)
        # Compiling a grammar can take milliseconds: here, not on the decode thread.
        seq.constraint = await asyncio.to_thread(
            self.constrainer.state,
            job,
            self.card,
            in_reasoning=seq.starts_in_reasoning,
            resume=seq.resume,
        )
        self.scheduler.submit(seq)
        finished = False
        paced = self.stream_interval_s > 0
        due = 0.0 if paced else None  # loop time from which the next batch may go out
        try:
            while not finished:
                batch, error = await box.take(due)
                if batch:
                    finished = any(is_terminal(e) for e in batch)
                    due = loop.time() + self.stream_interval_s if paced else None
                    yield batch
                if error is not None:
                    raise error
        finally:
            if not finished:
                self.scheduler.cancel(seq)
                await freed

    @classmethod
    def load(cls, settings: Settings, model_spec: str, name: str | None) -> TorchBackend:
        """Load ``model_spec`` and build the backend the worker serves.

        Args:
            settings: device, dtype, threads, max_batch, cache budget (the reasoning default
                only matters where prompts are rendered: the API).
            model_spec: ``"smollm2"``, a ``.gguf`` path, or a Hugging Face directory.
            name: public model id (default: derived from the spec).

        Returns:
            A backend; call ``await backend.start()`` before ``generate``.

        Raises:
            ModelLoadError: the model cannot be loaded (the message says why).
        """
        # A model on the CPU kernels runs each step in sl_forward on ``threads``; torch only
        # does microseconds of work per step (embedding rows, the choice over the vocabulary),
        # so it keeps one thread, from before the load on: a thread that ever ran a torch op on
        # more threads keeps an idle libgomp team, and with more team threads than cores
        # libgomp stops spinning at barriers, so each of a step's ~300 barriers sleeps and
        # wakes through the kernel. One stream on a 2-core VM: 13-17 ms a step against 8-9 ms
        # (docs/benchmarks.md, "The machine kind"). A model torch runs gets them back.
        threads = settings.threads or torch.get_num_threads()
        torch.set_num_threads(1)
        loaded = load_model(
            model_spec,
            name=name or settings.model_name,
            device=settings.device,
            dtype=settings.dtype,
            cpu_kernels=settings.cpu_kernels,
            kernel_dir=settings.kernel_dir,
            prefill_threads=settings.prefill_threads,
        )
        if isinstance(loaded.model, QuantizedLlama):
            loaded.model.kernels.compute_threads = threads
        else:
            torch.set_num_threads(threads)
        return cls(
            loaded,
            max_batch=settings.max_batch,
            max_cached_tokens=settings.max_cached_tokens,
            kv_cache_bytes=settings.kv_cache_bytes,
            block_size=settings.kv_block_size,
            max_batched_tokens=settings.max_batched_tokens,
            prefill_stall=settings.prefill_stall,
            stream_interval_s=settings.stream_interval_s,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            cuda_graphs=settings.cuda_graphs,
            speculative_tokens=settings.speculative_tokens if settings.speculative else 0,
        )
