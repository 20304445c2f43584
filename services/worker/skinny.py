"""Linears of a few rows (a decode step's GEMVs) in one Triton kernel each, with the op before
them fused in: the residual add and RMSNorm before ``qkv``, ``gate_up`` and the head, SwiGLU's
gate before ``down_proj``.

Why: a decode step of one to sixteen sequences reads every weight once and does almost no
arithmetic, so its time is bytes and launches. cuBLAS's GEMV for one row reads the 8B shape's
weights at about 80 % of the copy bandwidth, and a small model's step is launch-bound: SmolLM2's
30 layers were eleven kernels each inside the graph, about 2.9 µs apiece. Here a kernel streams
BN rows of the weight per program (``tl.dot`` with the rows padded to 16, the smallest tile),
and the norm or the gate is computed from the input as it is read: three kernels a layer fewer.

Whether a site takes the kernel is measured, not assumed: the first time a site (a kind of
fusion, the weight's shape and dtype, the rows padded to a power of two) runs outside a graph
capture, ``_choose`` times the torch ops it replaces and each candidate block shape, and keeps
the fastest. The decode graphs' warm-up runs every bucket eagerly before capture, so captured
steps only read the choice. Elsewhere (the CPU, more than ``MAX_ROWS`` rows, no Triton) the
torch ops run as before.

Numerics are the unfused ops': fp32 accumulation, the norm's value rounded to the dtype before
its scale, the gate's activation rounded before the product (as ``fused_ops``); the norm's sum
of squares is taken in BK-wide chunks, so a bf16 result can differ from the separate kernel's in
the last bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from services.worker import fused_ops

try:  # Triton ships with torch's CUDA builds; the CPU wheel has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["ENABLED", "MAX_ROWS", "linear", "norm_linear", "swiglu_linear"]

ENABLED = True  # the benchmark's switch: False runs the torch ops everywhere
MAX_ROWS = 16  # tl.dot's smallest tile; more rows are a GEMM, cuBLAS's work
PLAIN, NORM, ADD_NORM, SWIGLU = 0, 1, 2, 3


@dataclass(frozen=True)
class Shape:
    """A candidate launch: weight rows per program, K per iteration, warps, pipeline stages."""

    bn: int
    bk: int
    warps: int = 4
    stages: int = 4


# Few rows per program keep every SM streaming (o_proj of the 8B shape has 4,096 rows: 256
# programs at 16); wider tiles halve the programs' norm prologue for large N.
CANDIDATES = (Shape(16, 256), Shape(32, 128), Shape(64, 128, stages=3))
# a site: (fusion, the weight's (N, K), its dtype, bias or not, the rows padded to a power of 2)
Key = tuple[int, tuple[int, int], torch.dtype, bool, int]
CHOICES: dict[Key, Shape | None] = {}  # site -> kernel shape, None: torch's ops
TIMINGS: dict[Key, dict[str, float]] = {}  # site -> seconds of each option, for benchmarks


def _rows_bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _usable(x: torch.Tensor) -> bool:
    return ENABLED and fused_ops.wanted(x) and x.shape[0] <= MAX_ROWS


def _launch(
    shape: Shape,
    mode: int,
    x: torch.Tensor,
    layer: nn.Linear,
    delta: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One skinny kernel: ``layer(prologue(x))`` and, for ADD_NORM, ``x + delta``."""
    w = layer.weight
    m, n = x.shape[0], w.shape[0]
    k = x.shape[1] // 2 if mode == SWIGLU else x.shape[1]
    y = torch.empty(m, n, dtype=w.dtype, device=x.device)
    total = torch.empty_like(x) if mode == ADD_NORM else x
    d = delta if delta is not None else x
    bias = layer.bias if layer.bias is not None else w
    _skinny_kernel[(triton.cdiv(n, shape.bn),)](
        x, d, norm if norm is not None else w, w, bias, y, total,
        m, n, k, x.stride(0), d.stride(0), w.stride(0), y.stride(0), eps,
        MODE=mode, BIAS=layer.bias is not None,
        PREC="ieee" if w.dtype == torch.float32 else "tf32",
        BM=MAX_ROWS, BN=shape.bn, BK=shape.bk, num_warps=shape.warps, num_stages=shape.stages,
    )  # fmt: skip
    return total, y


def _timed(fn: Callable[[], object], repeats: int = 25) -> float:
    """Median device seconds of ``fn`` (CUDA events), after two warm-up calls (compiles)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2] / 1e3)


def _choose(
    key: Key, unfused: Callable[[], object], fused: Callable[[Shape], object]
) -> Shape | None:
    """The site's measured choice: a kernel shape, or None where the torch ops are faster.
    Inside a graph capture an unmeasured site takes the torch ops (no timing can run there)."""
    if key in CHOICES:
        return CHOICES[key]
    if not fused_ops.FORCE and torch.cuda.is_current_stream_capturing():
        return None
    if fused_ops.FORCE:  # Triton's interpreter on CPU tensors: no timing, the first shape
        CHOICES[key] = CANDIDATES[0]
        return CANDIDATES[0]
    best: Shape | None = None
    best_s = _timed(unfused)
    TIMINGS[key] = {"torch": best_s}
    for shape in CANDIDATES:
        s = _timed(partial(fused, shape))
        TIMINGS[key][f"{shape.bn}x{shape.bk}"] = s
        if s < best_s:
            best, best_s = shape, s
    CHOICES[key] = best
    return best


def _key(mode: int, x: torch.Tensor, layer: nn.Linear) -> Key:
    n, k = layer.weight.shape
    return (mode, (n, k), layer.weight.dtype, layer.bias is not None, _rows_bucket(x.shape[0]))


def _torch(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)``."""
    if not _usable(x):
        return _torch(x, layer)
    shape = _choose(
        _key(PLAIN, x, layer), lambda: _torch(x, layer), lambda s: _launch(s, PLAIN, x, layer)
    )
    return _torch(x, layer) if shape is None else _launch(shape, PLAIN, x, layer)[1]


def norm_linear(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    layer: nn.Linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``x + delta`` (``x`` when ``delta`` is None) and
    ``layer(rms_norm(x + delta) * weight)``, as ``fused_ops.add_rms_norm`` then ``layer``."""

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return x, _torch(fused_ops.rms_norm(x, weight, eps), layer)
        total, h = fused_ops.add_rms_norm(x, delta, weight, eps)
        return total, _torch(h, layer)

    if not _usable(x):
        return unfused()
    mode = NORM if delta is None else ADD_NORM

    def fused(s: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(s, mode, x, layer, delta, weight, eps)

    shape = _choose(_key(mode, x, layer), unfused, fused)
    return unfused() if shape is None else fused(shape)


def swiglu_linear(gate_up: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(silu(gate) * up)`` of ``gate_up`` (n, 2 I), as ``fused_ops.silu_mul``."""
    if not _usable(gate_up):
        return _torch(
            fused_ops.silu_mul(gate_up) if fused_ops.wanted(gate_up) else _silu(gate_up), layer
        )
    shape = _choose(
        _key(SWIGLU, gate_up, layer),
        lambda: _torch(fused_ops.silu_mul(gate_up), layer),
        lambda s: _launch(s, SWIGLU, gate_up, layer),
    )
    if shape is None:
        return _torch(fused_ops.silu_mul(gate_up), layer)
    return _launch(shape, SWIGLU, gate_up, layer)[1]


def _silu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _skinny_kernel(
        x_ptr, d_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, t_ptr,
        M, N, K, stride_x, stride_d, stride_w, stride_y, eps,
        MODE: tl.constexpr, BIAS: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        rows = tl.arange(0, BM)
        row_ok = rows < M
        cols = pid * BN + tl.arange(0, BN)
        col_ok = cols < N
        ks = tl.arange(0, BK)
        x_at = x_ptr + rows[:, None].to(tl.int64) * stride_x
        d_at = d_ptr + rows[:, None].to(tl.int64) * stride_d
        w_at = w_ptr + cols[:, None].to(tl.int64) * stride_w
        scale = tl.zeros((BM,), tl.float32)
        if MODE == 1 or MODE == 2:  # the rows' RMS first: every program reads them (from L2)
            squares = tl.zeros((BM,), tl.float32)
            for k0 in range(0, K, BK):
                ok = row_ok[:, None] & (k0 + ks[None, :] < K)
                raw = tl.load(x_at + k0 + ks[None, :], mask=ok, other=0.0)
                if MODE == 2:
                    step = tl.load(d_at + k0 + ks[None, :], mask=ok, other=0.0)
                    raw = (raw.to(tl.float32) + step.to(tl.float32)).to(raw.dtype)
                    if pid == 0:  # one program writes the residual stream
                        at = t_ptr + rows[:, None].to(tl.int64) * K + k0 + ks[None, :]
                        tl.store(at, raw, mask=ok)
                v = raw.to(tl.float32)
                squares += tl.sum(v * v, 1)
            scale = 1.0 / tl.sqrt(squares / K + eps)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            k_ok = k0 + ks < K
            ok = row_ok[:, None] & k_ok[None, :]
            if MODE == 3:  # silu(gate) * up, each rounded as torch rounds
                gate_raw = tl.load(x_at + k0 + ks[None, :], mask=ok, other=0.0)
                up = tl.load(x_at + K + k0 + ks[None, :], mask=ok, other=0.0).to(tl.float32)
                gate = gate_raw.to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(gate_raw.dtype).to(tl.float32)
                a = (act * up).to(gate_raw.dtype)
            else:
                a = tl.load(x_at + k0 + ks[None, :], mask=ok, other=0.0)
                if MODE == 2:
                    step = tl.load(d_at + k0 + ks[None, :], mask=ok, other=0.0)
                    a = (a.to(tl.float32) + step.to(tl.float32)).to(a.dtype)
                if MODE == 1 or MODE == 2:
                    nw = tl.load(nw_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                    normed = (a.to(tl.float32) * scale[:, None]).to(a.dtype).to(tl.float32)
                    a = (normed * nw[None, :]).to(a.dtype)
            w = tl.load(w_at + k0 + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(a.to(w.dtype), tl.trans(w), input_precision=PREC)
        if BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
