"""GPU engine benchmark: decode steps against the memory-bandwidth floor, prefill against the
matrix-multiply peak, on random weights of real model shapes.

For each shape (config.json values written below: SmolLM2-135M, Qwen3-0.6B, Llama-3.1-8B) in
bf16 on the device, the real ``Scheduler`` (paged KV cache, CUDA graphs, batched device sampler)
runs B sequences of their own random 1,024-token prompts, 128 greedy tokens each with EOS
ignored, for B in 1, 8, 32, 64, 128, 256. A decode step is timed around the engine's whole step
(host bookkeeping, the graph replay, sampling, the copy of the ids to the host); only steps where
all B sequences decode are counted. In the same run the device's copy bandwidth and bf16 matmul
rate are measured, and each decode step is compared with its bandwidth floor (weight bytes read
per step + KV bytes read per step, over the measured bandwidth) and a 1,024-token prefill with
the matmul peak.

    python3 -m ops.bench.gpu_engine --out results.jsonl          # on a GPU machine
    .venv/bin/python -m ops.bench.gpu_engine --device cpu --shapes tiny --batches 1 3 \\
        --prompt 40 --tokens 8                                    # a smoke run of the harness
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Tokenizer, models

from services.worker.models import MODELS
from services.worker.models.llama import LlamaModel
from services.worker.sampling import SamplingConfig
from services.worker.scheduler import Scheduler
from services.worker.sequence import SequenceState
from shared.events import AnyEvent, FinishReason, TokenLogprob
from shared.jobs import GenerateRequest, Job, Message, SamplingParams, TextPart

# config.json values of the published checkpoints (Hugging Face), weights random.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "tiny": {  # the harness's own smoke test
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    },
}


class CountOnly:
    """A decoder that emits nothing: the benchmark measures the engine, not detokenizing."""

    stop_reason: FinishReason | None = None

    def feed(self, token_id: int, logprob: TokenLogprob | None = None) -> list[AnyEvent]:
        return []

    def forced_next_token(self) -> int | None:
        return None

    def resume(self, token_ids: list[int]) -> None:
        return None

    def finish(self, reason: FinishReason) -> list[AnyEvent]:
        return []


def build(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """A random-weight model of ``shape`` in ``dtype`` on ``device``."""
    cfg = SHAPES[shape]
    cls = MODELS[cfg["architectures"][0]]
    config = cls.config_from_hf(cfg)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.no_grad():
            model = cls(config)
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def engine_scheduler(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    batch: int,
    context: int,
    budget: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Scheduler:
    """The real ``Scheduler`` for ``batch`` sequences of ``context`` tokens, with a decoder that
    emits nothing and no EOS (unstarted: ``start`` captures the decode graphs on a GPU)."""
    per_seq = -(-context // 16) + 1
    return Scheduler(
        model,
        tokenizer,
        eos_ids=[],
        max_batch=batch,
        device=device,
        dtype=dtype,
        make_decoder=lambda *_: CountOnly(),
        num_blocks=batch * per_seq + 8,
        max_batched_tokens=budget,
        cuda_graphs=device.type == "cuda",
    )


def weight_bytes_per_step(model: LlamaModel) -> int:
    """Weights a decode step reads: every parameter, except an untied embedding table (a step
    reads only its batch's rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def kv_bytes_per_token(model: LlamaModel, dtype: torch.dtype) -> int:
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.empty(0, dtype=dtype).itemsize


def device_time(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median seconds of ``fn`` on the device (CUDA events), or wall time on the CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return float(statistics.median(times))


def machine(device: torch.device) -> dict[str, float]:
    """The device's copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_s = device_time(lambda: b.copy_(a), device)
    m = 8192 if device.type == "cuda" else 512
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_s = device_time(lambda: x @ y, device)
    return {"copy_bytes_per_s": 2 * n / copy_s, "bf16_flops": 2 * m**3 / mm_s}


def prefill_fraction(
    model: LlamaModel, prompt: int, peak: float, device: torch.device
) -> dict[str, Any]:
    """One ``prompt``-token forward (SDPA's fused causal kernel) against the matmul peak."""
    from services.worker.kv_cache import PagedKVCache, SeqRows, build_batch

    c = model.config
    cache = PagedKVCache(
        layers=c.num_layers,
        num_blocks=prompt // 16 + 2,
        block_size=16,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=model.embed_tokens.weight.dtype,
        device=device,
    )
    table = cache.extend([], -(-prompt // 16))
    batch = build_batch([SeqRows(0, table, 0, prompt, 1)], 16, device)
    ids = torch.randint(0, c.vocab_size, (prompt,), device=device)
    with torch.inference_mode():
        seconds = device_time(lambda: model(ids, batch, cache), device, repeats=5)
    linear = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() > 1
    )
    attn = 4 * c.num_layers * c.num_heads * c.head_dim * prompt * prompt / 2  # causal half
    flops = 2 * prompt * linear + attn + 2 * c.hidden_size * c.vocab_size  # one logits row
    return {
        "prefill_s": seconds,
        "prefill_tflops": flops / seconds / 1e12,
        "of_peak": flops / seconds / peak,
    }


def job(i: int, ids: list[int], tokens: int) -> Job:
    req = GenerateRequest(
        request_id=f"bench-{i}",
        model="bench",
        messages=[Message(role="user", content=[TextPart(text="-")])],
        sampling=SamplingParams(temperature=0.0),
        max_tokens=tokens,
        ignore_eos=True,
    )
    return Job.of(req, prompt_token_ids=ids, prompt_text="")


def decode_run(
    sched: Scheduler, batch: int, prompt: int, tokens: int, vocab: int
) -> dict[str, Any]:
    """``batch`` sequences with their own prompts, all submitted at once; decode-only steps of
    all of them timed around the engine's step."""
    steps: list[tuple[float, int, bool]] = []
    replay: list[float] = []  # the graph alone, replayed on a full step's inputs
    inner = sched._step

    def timed(rows: list[tuple[SequenceState, int]]) -> None:
        began = time.perf_counter()
        inner(rows)
        decode = all(n == 1 for _, n in rows)
        steps.append((time.perf_counter() - began, len(rows), decode))
        graphs = sched.graphs
        if decode and len(rows) == batch and len(steps) > 32 and not replay and graphs:
            # (rewrites this step's keys and values with the same numbers: harmless)
            graph = graphs.graphs[batch][0]
            replay.append(device_time(graph.replay, sched.device, repeats=10))

    sched._step = timed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(batch)
    done = threading.Semaphore(0)
    began = time.perf_counter()
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        seq = SequenceState(
            job=job(i, ids, tokens),
            prompt=ids,
            resume=[],
            attempt=1,
            starts_in_reasoning=False,
            sampling=SamplingConfig(temperature=0.0),
            generator=None,
            max_new=tokens,
            emit=lambda _: None,
            on_freed=done.release,
        )
        sched.submit(seq)
    for _ in range(batch):
        if not done.acquire(timeout=600):
            raise TimeoutError("a sequence did not finish in 10 minutes")
    wall = time.perf_counter() - began
    sched._step = inner  # type: ignore[method-assign]
    full = [s for s, n, decode in steps if decode and n == batch]
    step = statistics.median(full) if full else float("nan")
    return {
        "batch": batch,
        "decode_steps": len(full),
        "step_ms": step * 1e3,
        "replay_ms": replay[0] * 1e3 if replay else float("nan"),
        "decode_tok_s": batch / step,
        "wall_s": wall,
        "wall_tok_s": batch * tokens / wall,
    }


def bench_shape(
    shape: str, args: argparse.Namespace, hw: dict[str, Any], emit: Callable[[dict[str, Any]], None]
) -> None:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t = time.perf_counter()
    model = build(shape, device, dtype)
    built_s = time.perf_counter() - t
    c = model.config
    top = max(args.batches)
    tok = Tokenizer(models.WordLevel({"x": 0}, unk_token="x"))
    t = time.perf_counter()
    sched = engine_scheduler(model, tok, top, args.prompt + args.tokens, args.budget, device, dtype)
    sched.start()
    capture_s = time.perf_counter() - t
    weights = weight_bytes_per_step(model)
    per_kv = kv_bytes_per_token(model, sched.cache.dtype)
    emit(
        {
            "shape": shape,
            "weights_gb": weights / 1e9,
            "build_s": built_s,
            "capture_s": capture_s,
            "graphs": sorted(sched.graphs.graphs) if sched.graphs else [],
        }
    )
    emit({"shape": shape, **prefill_fraction(model, args.prompt, hw["bf16_flops"], device)})
    try:
        for b in args.batches:
            row = decode_run(sched, b, args.prompt, args.tokens, c.vocab_size)
            # keys read by a step: each sequence's context, mid-way through its 128 tokens
            kv = b * (args.prompt + args.tokens // 2) * per_kv
            floor = (weights + kv) / hw["copy_bytes_per_s"]
            row |= {
                "shape": shape,
                "floor_ms": floor * 1e3,
                "step_over_floor": row["step_ms"] / 1e3 / floor,
                "roofline_tok_s": b / floor,
                "of_roofline": floor / (row["step_ms"] / 1e3),
            }
            emit(row)
    finally:
        sched.stop()
        del sched, model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=128)
    # large, so every batch's prompts are read before its first sequences finish: the decode
    # steps measured are those of all B sequences
    p.add_argument("--budget", type=int, default=16384, help="SLUICE_MAX_BATCHED_TOKENS")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args()

    def emit(row: dict[str, Any]) -> None:
        line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    hw = machine(device)
    emit({"device": name, "torch": torch.__version__, **hw})
    for shape in args.shapes:
        try:
            bench_shape(shape, args, hw, emit)
        except Exception as exc:  # keep the other shapes' numbers
            emit({"shape": shape, "error": repr(exc)})


if __name__ == "__main__":
    main()
