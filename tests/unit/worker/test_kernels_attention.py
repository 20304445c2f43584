"""The kernels' attention (RoPE, optional q/k norm, KV-cache write, GQA softmax attention) over
the paged KV cache, on the native, AVX2 and scalar builds.

Against torch: a ragged batch (a decode row beside prefill chunks of different lengths, each
sequence with a different cached prefix, its blocks scattered through the pool) attends as a
float64 reference over each sequence's keys laid out contiguously. The cache holds IEEE halves:
the reference stores its keys and values through torch's fp32 -> fp16 rounding.

Against itself, bit for bit: where a sequence's blocks are and how large, how its tokens are
split into calls (one chunk, several, one at a time), what else is in the batch, and whether its
prefix blocks are its own or shared with another sequence change nothing in its outputs or its
cached keys and values (attend.c: ``attend`` reads keys in the same groups and sums values in
the same order whatever the blocks)."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.kernels import Kernels
from services.worker.models.llama import LlamaConfig, LlamaModel, RMSNorm, rotate_half
from tests.worker_models import gen as _gen

torch.set_num_threads(1)

H, KV = 4, 2
CONTEXT = 128  # positions the RoPE tables cover


def _rope_tables(hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables a real ``LlamaModel`` builds."""
    cfg = LlamaConfig(
        vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=H,
        num_kv_heads=KV, head_dim=hd, rope_theta=10000.0, context_length=CONTEXT,
    )  # fmt: skip
    model = LlamaModel(cfg)
    return model.rope_cos.contiguous(), model.rope_sin.contiguous()


def _norms(hd: int, eps: float, g: torch.Generator) -> tuple[RMSNorm, RMSNorm]:
    """Qwen3's per-head q_norm and k_norm, with weights away from 1."""
    q_norm, k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
    with torch.no_grad():
        q_norm.weight.copy_(1.0 + 0.3 * torch.randn(hd, generator=g))
        k_norm.weight.copy_(1.0 + 0.3 * torch.randn(hd, generator=g))
    return q_norm, k_norm


# ---- the paged cache --------------------------------------------------------------------------


def _pool(num_blocks: int, bs: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty pool of blocks: keys 1e4 and values NaN, so a read of a place no sequence wrote
    (past a position, an unused block) wrecks the output instead of passing unnoticed."""
    kc = torch.full((KV, num_blocks, bs, hd), 1e4, dtype=torch.half)
    vc = torch.full((KV, num_blocks, bs, hd), float("nan"), dtype=torch.half)
    # the kernels' layout, heads outermost, seen block first for indexing by block
    return kc.transpose(0, 1), vc.transpose(0, 1)


def _tables(blocks: list[list[int]], stride: int, unused: int) -> torch.Tensor:
    """Block tables (n_seq, stride) int32; entries past a sequence's blocks name ``unused``."""
    return torch.tensor([b + [unused] * (stride - len(b)) for b in blocks], dtype=torch.int32)


def _dense(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Each sequence's keys (values) contiguous: (n_seq, KV, stride * block_size, hd)."""
    n_seq, stride = tables.shape
    _, kv, bs, hd = cache.shape
    return cache[tables.long()].permute(0, 2, 1, 3, 4).reshape(n_seq, kv, stride * bs, hd)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit patterns, so NaNs compare equal to themselves."""
    return x.view(torch.int16 if x.dtype == torch.half else torch.int32)


def _attention(
    k: Kernels, rows: torch.Tensor, pos: list[int], seq: list[int], tables: torch.Tensor,
    kc: torch.Tensor, vc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, eps: float = 1e-6,
    threads: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``sl_attention`` over the token rows ``rows`` (rotated in place, keys and values written
    into kc/vc); their outputs (n, H * hd)."""
    n, hd = rows.shape[0], kc.shape[-1]
    threads = threads or k.threads()
    out = torch.full((n, H * hd), float("nan"))
    pos_t, seq_t = torch.tensor(pos), torch.tensor(seq)
    span = max(pos) + 1
    k.lib.sl_attention(
        n, H, KV, hd, rows.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos_t.data_ptr(),
        seq_t.data_ptr(), tables.data_ptr(), tables.shape[1], kc.shape[2], kc.shape[0],
        kc.data_ptr(),
        vc.data_ptr(), 0 if q_norm is None else q_norm.weight.data_ptr(),
        0 if k_norm is None else k_norm.weight.data_ptr(), eps, out.data_ptr(),
        span, threads,
    )  # fmt: skip
    return out


def _ref_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: list[int], seq: list[int],
    keys: torch.Tensor, vals: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
) -> torch.Tensor:  # fmt: skip
    """Torch attention over contiguous per-sequence caches ``keys``/``vals`` (n_seq, KV, S, hd):
    every row's roped key and raw value written first, then each query over its sequence's
    positions 0..pos in float64."""
    hd = keys.shape[-1]
    queries = []
    for r, (p, s) in enumerate(zip(pos, seq, strict=True)):
        q, key, val = qkv[r].split([H * hd, KV * hd, KV * hd])
        q, key, val = q.view(H, hd), key.view(KV, hd), val.view(KV, hd)
        if q_norm is not None and k_norm is not None:
            q, key = q_norm(q), k_norm(key)
        queries.append(q * cos[p] + rotate_half(q) * sin[p])
        keys[s, :, p] = key * cos[p] + rotate_half(key) * sin[p]
        vals[s, :, p] = val
    out = []
    for q, p, s in zip(queries, pos, seq, strict=True):
        ks, vs = keys[s, :, : p + 1].double(), vals[s, :, : p + 1].double()  # (KV, S, hd)
        heads = []
        for h in range(H):
            kv = h // (H // KV)
            att = (ks[kv] @ q[h].double()) / math.sqrt(hd)  # (S,)
            heads.append(att.softmax(-1) @ vs[kv])
        out.append(torch.cat(heads))
    return torch.stack(out).float()  # (n, H * hd)


# ---- against torch ----------------------------------------------------------------------------


@pytest.mark.parametrize("hd", [16, 64, 80])  # 64: the register-blocked output path; 80: both
@pytest.mark.parametrize("qwen3", [False, True], ids=["llama", "qk-norm"])
def test_ragged_paged_attention_matches_torch(k: Kernels, qwen3: bool, hd: int) -> None:
    g = _gen(200 + qwen3 + hd)
    cos, sin = _rope_tables(hd)
    bs, stride, num_blocks, eps = 16, 3, 11, 1e-6
    # Three sequences (table rows 3, 0 and 4 of 5; 1 and 2 unused): one decode row after 30
    # cached tokens (31 keys: a whole block, then 15 with a tail of 3 past the groups of four),
    # a chunk of 5 after 11 (12 to 16 keys: the last fills its block exactly), and a chunk of 17
    # after 7, across a block boundary. Rows of one sequence need not be adjacent.
    cached = {3: 30, 0: 11, 4: 7}
    new = {3: 1, 0: 5, 4: 17}
    pos, seq = [], []
    for s in (0, 4):
        pos += list(range(cached[s], cached[s] + new[s]))
        seq += [s] * new[s]
    at = 2  # the decode row among the chunk's rows
    pos.insert(at, cached[3])
    seq.insert(at, 3)
    # Blocks scattered through the pool, neither sorted nor contiguous; the last one unused,
    # poisoned, and named by every table entry past a sequence's blocks.
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    blocks = {3: order[0:2], 0: order[2:3], 4: order[3:5]}
    unused = num_blocks - 1
    tables = _tables([blocks.get(s, []) for s in range(5)], stride, unused)
    kc, vc = _pool(num_blocks, bs, hd)
    for s, n in cached.items():  # the cached prefixes: random halves at 0..n-1
        for p in range(n):
            block = blocks[s][p // bs]
            kc[block, :, p % bs] = torch.randn(KV, hd, generator=g).half()
            vc[block, :, p % bs] = torch.randn(KV, hd, generator=g).half()
    qkv = torch.randn(len(pos), (H + 2 * KV) * hd, generator=g) * 2
    q_norm, k_norm = _norms(hd, eps, g) if qwen3 else (None, None)
    keys, vals = _dense(kc, tables), _dense(vc, tables)
    with torch.no_grad():
        want = _ref_attention(qkv, cos, sin, pos, seq, keys, vals, q_norm, k_norm)
    kc0, vc0 = kc.clone(), vc.clone()
    out = _attention(k, qkv.clone(), pos, seq, tables, kc, vc, cos, sin, q_norm, k_norm, eps)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # Each row's roped key and raw value sit at its position's place in its sequence's blocks;
    # nothing else in the pool moved.
    written = torch.zeros(num_blocks, KV, bs, dtype=torch.bool)
    for p, s in zip(pos, seq, strict=True):
        written[blocks[s][p // bs], :, p % bs] = True
        got_k, got_v = kc[blocks[s][p // bs], :, p % bs], vc[blocks[s][p // bs], :, p % bs]
        # the roped key, computed in fp32 by both, may round to the neighbouring half; the value
        # is stored as given, rounded the same way by both
        torch.testing.assert_close(got_k, keys[s, :, p], rtol=1e-3, atol=1e-6)
        assert torch.equal(_bits(got_v), _bits(vals[s, :, p]))
    assert torch.equal(_bits(kc[~written]), _bits(kc0[~written]))
    assert torch.equal(_bits(vc[~written]), _bits(vc0[~written]))


def test_the_cache_rounds_like_torch_half(k: Kernels) -> None:
    """Values go into the cache rounded to nearest, ties to even, on every build (F16C's
    vcvtps2ph natively, ``float_to_half`` in the scalar build), exactly as torch's ``.half()``:
    normal values, ties, the subnormal range, overflow to infinity, signed zeros."""
    hd, bs = 64, 8
    g = _gen(400)
    ulp = 2.0**-10  # a half's spacing in [1, 2)
    special = [1 + ulp / 2, 1 + 3 * ulp / 2, 2**-14, 2**-15 * 3, 2**-24, 2**-25, 2**-26,
               65504.0, 65519.0, 65520.0, 1e9, -0.0, 0.0, 6e-8, -3.1e-5]  # fmt: skip
    values = torch.cat([torch.tensor(special), torch.randn(hd * 8, generator=g) * 300])
    values = torch.cat([values, values * 2.0**-20])[: (values.numel() * 2 // hd) * hd]
    cos, sin = _rope_tables(hd)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    for at in range(0, values.numel(), hd):
        val = values[at : at + hd]
        qkv = torch.zeros(1, (H + 2 * KV) * hd)
        qkv[0, (H + KV) * hd : (H + KV + 1) * hd] = val  # the first KV head's value
        kc, vc = _pool(1, bs, hd)
        _attention(k, qkv, [0], [0], tables, kc, vc, cos, sin)
        assert torch.equal(_bits(vc[0, 0, 0]), _bits(val.half()))


# ---- bit for bit, whatever the blocks and the calls ---------------------------------------------


def _scattered(n_blocks: int, num_blocks: int, g: torch.Generator) -> list[int]:
    """n_blocks distinct block ids out of num_blocks, in a scrambled order."""
    return torch.randperm(num_blocks, generator=g)[:n_blocks].tolist()


@pytest.mark.parametrize("hd", [16, 64, 80])
@pytest.mark.parametrize("qwen3", [False, True], ids=["llama", "qk-norm"])
def test_outputs_do_not_depend_on_the_blocks_or_the_calls(k: Kernels, qwen3: bool, hd: int) -> None:
    """One sequence of 45 tokens (two whole blocks of 16 and a partial one; one whole block of
    32 and a partial one) computed by layouts and schedules that must all agree bit for bit:
    a contiguous table or a scrambled one, blocks of 8, 16 or 32 halves per head, one chunk,
    uneven chunks, token by token (decode: the per-query-head schedule), beside another
    sequence's rows in a ragged batch, and on more threads. The cached keys and values agree
    too."""
    g = _gen(300 + qwen3 + hd)
    cos, sin = _rope_tables(hd)
    length, num_blocks, eps = 45, 24, 1e-6
    qkv = torch.randn(length, (H + 2 * KV) * hd, generator=g)
    q_norm, k_norm = _norms(hd, eps, g) if qwen3 else (None, None)

    def run(
        bs: int, blocks: list[int], chunks: list[int], other: bool = False, threads: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequence (table row 1) in calls of ``chunks`` tokens; ``other``: each call also
        carries two tokens of a second sequence (table row 0), one before this one's rows and
        one after."""
        stride = -(-2 * length // bs)  # room for the second sequence's 2 tokens a call
        kc, vc = _pool(num_blocks, bs, hd)
        theirs = [b for b in range(num_blocks - 1) if b not in blocks][:stride]
        tables = _tables([theirs, blocks], stride, num_blocks - 1)
        outs, start, at = [], 0, 0
        for n in chunks:
            rows, pos, seq = qkv[start : start + n].clone(), list(range(start, start + n)), [1] * n
            if other:
                extra = torch.randn(2, qkv.shape[1], generator=g)
                rows = torch.cat([extra[:1], rows, extra[1:]])
                pos, seq, at = [at, *pos, at + 1], [0, *seq, 0], at + 2
            out = _attention(
                k, rows, pos, seq, tables, kc, vc, cos, sin, q_norm, k_norm, eps, threads
            )
            outs.append(out[1:-1] if other else out)
            start += n
        assert start == length
        dense = (_dense(kc, tables)[1, :, :length], _dense(vc, tables)[1, :, :length])
        return torch.cat(outs), *dense

    one_chunk = [length]
    want, want_k, want_v = run(16, list(range(3)), one_chunk)  # contiguous
    assert not want.isnan().any()
    layouts = {
        "scrambled": (16, _scattered(3, num_blocks - 1, g), one_chunk),
        "blocks of 32": (32, _scattered(2, num_blocks - 1, g), one_chunk),
        "blocks of 8": (8, _scattered(6, num_blocks - 1, g), one_chunk),
        "uneven chunks": (16, _scattered(3, num_blocks - 1, g), [7, 20, 1, 17]),
        "chunks, blocks of 32": (32, _scattered(2, num_blocks - 1, g), [16, 16, 13]),
        "token by token": (16, _scattered(3, num_blocks - 1, g), [1] * length),
    }
    for name, (bs, blocks, chunks) in layouts.items():
        got, got_k, got_v = run(bs, blocks, chunks)
        assert torch.equal(got, want), name
        assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))
    got, *_ = run(16, _scattered(3, num_blocks - 1, g), [9, 36], other=True)
    assert torch.equal(got, want), "in a ragged batch"
    got, *_ = run(32, _scattered(2, num_blocks - 1, g), [5, 40], threads=3)
    assert torch.equal(got, want), "on three threads"
    got, *_ = run(16, _scattered(3, num_blocks - 1, g), [1] * length, other=True, threads=2)
    assert torch.equal(got, want), "decode beside another sequence, on two threads"


@pytest.mark.parametrize("hd", [16, 64])
def test_sequences_sharing_prefix_blocks(k: Kernels, hd: int) -> None:
    """Two sequences whose tables name the same two blocks for a prefilled 32-token prefix, each
    with a block of its own after it, continue in one call (a chunk of 5 and a decode row, then
    a decode row each): they read the prefix's keys and values where the first wrote them, get
    the bits each would get with a prefix of its own, and leave the shared blocks alone."""
    g = _gen(500 + hd)
    cos, sin = _rope_tables(hd)
    bs, prefix, num_blocks = 16, 32, 10
    width = (H + 2 * KV) * hd
    head = torch.randn(prefix, width, generator=g)  # the common prompt's rows
    tails = [torch.randn(6, width, generator=g), torch.randn(2, width, generator=g)]
    # each call's rows of each sequence: (sequence, first tail row, rows)
    calls = [[(0, 0, 5), (1, 0, 1)], [(1, 1, 1), (0, 5, 1)]]

    def continue_(
        tables: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> list[list[torch.Tensor]]:
        """The calls, after a prefix cached for both sequences; each sequence's outputs."""
        outs: list[list[torch.Tensor]] = [[], []]
        for call in calls:
            rows = torch.cat([tails[s][t : t + n] for s, t, n in call])
            pos = [prefix + t + i for _, t, n in call for i in range(n)]
            seq = [s for s, _, n in call for _ in range(n)]
            out = _attention(k, rows, pos, seq, tables, kc, vc, cos, sin)
            at = 0
            for s, _, n in call:
                outs[s].append(out[at : at + n])
                at += n
        return outs

    # Shared: sequence 0 prefills the prefix into blocks 7 and 2; sequence 1's table names the
    # same two, then a block of its own.
    kc, vc = _pool(num_blocks, bs, hd)
    tables = _tables([[7, 2, 5], [7, 2, 0]], 3, num_blocks - 1)
    _attention(k, head.clone(), list(range(prefix)), [0] * prefix, tables, kc, vc, cos, sin)
    shared_k, shared_v = kc[[7, 2]].clone(), vc[[7, 2]].clone()
    shared = continue_(tables, kc, vc)
    assert torch.equal(_bits(kc[[7, 2]]), _bits(shared_k))
    assert torch.equal(_bits(vc[[7, 2]]), _bits(shared_v))
    # Apart: each sequence prefills the prefix into blocks of its own.
    kc, vc = _pool(num_blocks, bs, hd)
    tables = _tables([[3, 8, 1], [6, 4, 0]], 3, num_blocks - 1)
    rows = torch.cat([head, head])
    _attention(k, rows, [*range(prefix)] * 2, [0] * prefix + [1] * prefix, tables, kc, vc, cos, sin)
    assert torch.equal(_bits(kc[[3, 8]]), _bits(shared_k))
    assert torch.equal(_bits(kc[[6, 4]]), _bits(shared_k))
    apart = continue_(tables, kc, vc)
    for s in range(2):
        got, want = torch.cat(shared[s]), torch.cat(apart[s])
        assert not got.isnan().any()
        assert torch.equal(got, want), f"sequence {s}"
