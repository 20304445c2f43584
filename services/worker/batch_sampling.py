"""Token choice for a whole step at once, on the logits' own device (the GPU engine's sampler).

The CPU engine chooses per sequence (``sampling.py``): its logits are already in host memory and
one row costs microseconds. On a GPU, copying 256 rows of a 128k vocabulary to the host every
step would cost more than the forward, and a per-row ``.item()`` synchronises the device 256
times. Here every filter is a batched tensor operation over the rows that need it, and the step
ends with one device-to-host copy of the chosen ids.

The semantics are ``sampling.py``'s: penalties (presence and frequency over generated tokens,
repetition over prompt and generated), EOS banned under ``min_tokens`` / ``ignore_eos``,
temperature, then top-k, top-p over what top-k left, min-p over what top-p left; greedy rows take
the first maximum; a token forced by the output decoder (a reasoning marker) wins.

Randomness is counter-based, not a generator's state: the draw for a row is an exponential race
(``argmax p_i / E_i`` with ``E_i`` exponential picks token i with probability p_i, the Gumbel-max
trick) whose uniforms hash (seed, position, token). The same seed and token history give the same
token whatever else is in the batch, on any device, and a request resumed on another worker from
its published tokens draws what the lost worker would have drawn next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sampling import SamplingConfig

__all__ = ["RowChoice", "choose_tokens", "hash_uniform"]

MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    c &= MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64's constants (Steele, Lea and Flood, "Fast splittable pseudorandom number generators")
GOLDEN = _signed(0x9E3779B97F4A7C15)
MIX1 = _signed(0xBF58476D1CE4E5B9)
MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hash_uniform(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), (rows, vocab) fp32: splitmix64 of (seed, counter, token) per entry.

    Integer multiplies wrap modulo 2^64 on every device torch runs on, so the bits are the same
    on the CPU and the GPU."""
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * GOLDEN + counters[:, None] * MIX2 + tokens[None, :] * MIX1
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    x = x ^ _shr(x, 31)
    # 23 bits: every (n + 0.5) / 2^23 is exact in fp32, the largest 1 - 2^-24 (24 bits would
    # round 2^24 - 0.5 up to 2^24, a uniform of 1.0: a race of 0 that any token, even one of
    # probability 0, wins)
    return (_shr(x, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass(frozen=True)
class RowChoice:
    """One logits row's knobs for ``choose_tokens``."""

    sampling: SamplingConfig
    seed: int  # the request's seed (a random one when the request gave none)
    counter: int  # the position of the token being chosen: a fresh draw per position
    ban_eos: bool = False  # min_tokens not reached, or ignore_eos
    counts: torch.Tensor | None = None  # (V,) generated-token counts (frequency / presence)
    seen: torch.Tensor | None = None  # (V,) bool prompt + generated (repetition)
    forced: int | None = None  # the decoder's forced next token
    logprobs: int = -1  # -1: none; else how many alternatives beside the chosen token


Logprob = tuple[float, list[tuple[int, float]]]


def choose_tokens(
    logits: torch.Tensor, rows: list[RowChoice], eos_ids: list[int]
) -> tuple[list[int], list[Logprob | None]]:
    """The next token of each row of ``logits`` (m, V) fp32, and for rows that ask, the chosen
    token's log-probability under ``logits`` with the best alternatives (before penalties and
    filters, as ``sampling.token_logprob``)."""
    m, vocab = logits.shape
    dev = logits.device
    work = logits
    pen = [i for i, r in enumerate(rows) if r.counts is not None or r.seen is not None]
    if pen:
        work = work.clone()
        work[pen] = _penalised(work[pen], [rows[i] for i in pen])
    banned = [i for i, r in enumerate(rows) if r.ban_eos]
    eos = [e for e in eos_ids if e < vocab]
    if banned and eos:
        work = work.clone() if work is logits else work
        work[torch.tensor(banned, device=dev)[:, None], torch.tensor(eos, device=dev)[None, :]] = (
            float("-inf")
        )
    chosen = work.argmax(dim=-1)  # greedy rows keep it
    drawn = [i for i, r in enumerate(rows) if not r.sampling.greedy and r.forced is None]
    if drawn:
        chosen[drawn] = _draw(work[drawn], [rows[i] for i in drawn])
    forced = [i for i, r in enumerate(rows) if r.forced is not None]
    if forced:
        chosen[forced] = torch.tensor([rows[i].forced for i in forced], device=dev)
    wanted = [i for i, r in enumerate(rows) if r.logprobs >= 0]
    if not wanted:
        return chosen.tolist(), [None] * m  # the step's one copy to the host
    k = max(rows[i].logprobs for i in wanted)
    logp = torch.log_softmax(logits[wanted], dim=-1)
    own = logp.gather(1, chosen[wanted][:, None])[:, 0]
    top_v, top_i = torch.topk(logp, k) if k else (logp[:, :0], logp[:, :0].long())
    tokens, own_l, top_v_l, top_i_l = (
        chosen.tolist(),
        own.tolist(),
        top_v.tolist(),
        top_i.tolist(),
    )
    out: list[Logprob | None] = [None] * m
    for j, i in enumerate(wanted):
        n = rows[i].logprobs
        out[i] = (own_l[j], list(zip(top_i_l[j][:n], top_v_l[j][:n], strict=True)))
    return tokens, out


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, device=like.device, dtype=like.dtype)[:, None]


def _penalised(x: torch.Tensor, rows: list[RowChoice]) -> torch.Tensor:
    """``sampling.apply_penalties`` on several rows at once."""
    vocab = x.shape[1]
    cfg = [r.sampling for r in rows]
    zeros = torch.zeros(vocab, device=x.device)
    counts = torch.stack([r.counts if r.counts is not None else zeros for r in rows])
    seen = torch.stack([r.seen if r.seen is not None else zeros.bool() for r in rows])
    rep = _column([c.repetition_penalty for c in cfg], x)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - _column([c.frequency_penalty for c in cfg], x) * counts
    return x - _column([c.presence_penalty for c in cfg], x) * (counts > 0).to(x.dtype)


def _filtered(x: torch.Tensor, cfg: list[SamplingConfig]) -> torch.Tensor:
    """``sampling.filter_logits`` on several rows: temperature, then top-k, top-p, min-p, done
    in sorted order so one sort serves the three."""
    x = x / _column([max(c.temperature, 1e-6) for c in cfg], x)
    if all(c.top_k <= 0 and c.top_p >= 1.0 and c.min_p <= 0.0 for c in cfg):
        return x
    vocab = x.shape[1]
    ordered, order = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    top_k = _column([c.top_k if 0 < c.top_k < vocab else vocab for c in cfg], x)
    ordered = ordered.masked_fill(rank >= top_k, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    # top_p 1 is off: the fp32 cumulative sum reaches 1.0 before a long tail, which must stay
    top_p = _column([c.top_p if c.top_p < 1.0 else float("inf") for c in cfg], x)
    ordered = ordered.masked_fill(before >= top_p, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    floor = _column([c.min_p for c in cfg], x) * probs[:, :1]  # the most likely stays first
    ordered = ordered.masked_fill(probs < floor, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, ordered)


def _draw(x: torch.Tensor, rows: list[RowChoice]) -> torch.Tensor:
    """One token per row from softmax(filtered ``x``): the exponential race (module doc)."""
    probs = torch.softmax(_filtered(x, [r.sampling for r in rows]), dim=-1)
    # a request's seed is any 64-bit value: the same bits as torch's int64 holds them
    seeds = torch.tensor([_signed(r.seed) for r in rows], device=x.device, dtype=torch.int64)
    counters = torch.tensor([r.counter for r in rows], device=x.device, dtype=torch.int64)
    race = -torch.log(hash_uniform(seeds, counters, x.shape[1]))  # exponential(1)
    return (probs / race).argmax(dim=-1)
