"""The GGUF weight formats the CPU kernels read exactly (Q4_0, Q4_1, Q8_0, and Q4_K as Q4_1
blocks): packing raw blocks against the ``gguf`` package's reference dequantization, each
format's GEMM / GEMV on an exact grid against float64 (native, AVX2 and scalar builds), and tiny
models written as each format against the dense model's logits."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker import kernels
from services.worker.kernels import (
    FLAGS,
    MIRRORS,
    BlockQ4_0,
    BlockQ4_1,
    BlockQ8_0,
    Kernels,
    build,
)
from services.worker.kv_cache import build_batch
from services.worker.loaders import ModelLoadError, load_model
from services.worker.loaders.gguf import load_gguf
from services.worker.models.blocks import (
    BLOCK_BYTES,
    Q8_16,
    Q8_M,
    X8,
    QuantBlocks,
    dequantize_blocks,
    pack_blocks,
)
from services.worker.models.quantized import Activations, PackedLinear, QuantizedLlama
from tests.worker_models import (
    ARCH_MODEL_TYPE,
    gen,
    hf_state_dict,
    model_cache,
    prefill_logits,
    quantize_q4_k,
    random_model,
    tiny_tokenizer,
    write_gguf,
)

torch.set_num_threads(1)

QK = 32
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]  # gguf-py writes these (and Q5_0 / Q5_1)


def _blocks(a: np.ndarray, qtype: Q) -> QuantBlocks:
    raw = gguf.quants.quantize(a, qtype)
    n, k = a.shape
    return QuantBlocks(int(qtype), torch.from_numpy(raw.copy()).view(n, -1), (n, k))


def _unpacked(b: QuantBlocks) -> torch.Tensor:
    """The (N, K) weights the kernel's layout holds, read back from ``pack_blocks``' output."""
    fmt, q, d, m = pack_blocks(b)
    n, k = b.shape
    nb = k // QK
    if fmt == Q8_16:
        return (q.float().view(n, 2 * nb, 16) * d[..., None]).view(n, k)
    if q.dtype == torch.int8:  # Q8_0, Q8_M
        w = q.float().view(n, nb, QK) * d[..., None]
        return (w if m is None else w + m[..., None]).view(n, k)
    g = n // 8
    by = q.view(g, nb, 4, 8, 4).permute(0, 1, 3, 2, 4)  # (G, nb, row, j, i)
    v = torch.cat([(by & 0x0F).reshape(g, nb, 8, 16), (by >> 4).reshape(g, nb, 8, 16)], -1)
    low = -8.0 * d if m is None else m
    w = v.float() * d[..., None] + low[..., None]  # (G, nb, row, 32)
    return w.permute(0, 2, 1, 3).reshape(n, k)


@pytest.mark.parametrize("qtype", FORMATS)
def test_packed_blocks_hold_what_gguf_dequantizes(qtype: Q) -> None:
    a = np.random.default_rng(int(qtype)).standard_normal((24, 96)).astype(np.float32)
    b = _blocks(a, qtype)
    want = gguf.quants.dequantize(b.data.numpy(), qtype).reshape(24, 96)
    assert np.array_equal(dequantize_blocks(b).numpy(), want)
    assert np.array_equal(_unpacked(b).numpy(), want)


# where each type keeps its f16 halves, and how many values a block holds
HALVES = {Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _random_blocks(qtype: Q, n: int, kk: int, seed: int) -> QuantBlocks:
    """Blocks of random bytes (every byte pattern is valid) with small finite halves."""
    g = gen(seed)
    per = 256 if qtype in K_TYPES else QK
    raw = torch.randint(0, 256, (n, kk // per, BLOCK_BYTES[int(qtype)]), generator=g)
    raw = raw.to(torch.uint8)
    for at in HALVES[qtype]:
        half = (torch.rand(n, kk // per, 1, generator=g) * 0.004 + 0.0005).half()
        raw[..., at : at + 2] = half.view(torch.uint8)
    return QuantBlocks(int(qtype), raw.view(n, -1), (n, kk))


@pytest.mark.parametrize(
    ("qtype", "fmt"),
    [(Q.Q5_0, Q.Q8_0), (Q.Q5_1, Q8_M), (Q.Q4_K, Q.Q4_1), (Q.Q5_K, Q8_M), (Q.Q6_K, Q8_16)],
)
def test_5_and_6_bit_and_k_quant_blocks_pack_exactly(qtype: Q, fmt: int) -> None:
    b = _random_blocks(qtype, 16, 512, seed=int(qtype))
    want = gguf.quants.dequantize(b.data.numpy(), qtype).reshape(16, 512)
    assert np.array_equal(dequantize_blocks(b).numpy(), want)
    assert pack_blocks(b)[0] == int(fmt)
    assert np.array_equal(_unpacked(b).numpy(), want)


def test_the_test_q4_k_writer_is_what_gguf_reads() -> None:
    a = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    written = QuantBlocks(int(Q.Q4_K), torch.from_numpy(quantize_q4_k(a)), (8, 256))
    reference = gguf.quants.dequantize(written.data.numpy(), Q.Q4_K).reshape(8, 256)
    assert np.array_equal(_unpacked(written).numpy(), reference)
    assert np.abs(reference - a).max() < 0.1 * np.abs(a).max()  # the test quantizer is sane


def _grid(qtype: Q, n: int, kk: int, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    """Raw GGUF blocks with every value of each block's grid used, and the fp32 weights."""
    g = gen(seed)
    nb = kk // QK
    if qtype in HALVES:
        blocks = _random_blocks(qtype, n, kk, seed)
        return blocks, dequantize_blocks(blocks)
    d = (torch.rand(n, nb, generator=g) * 0.1 + 0.01).half()
    if qtype == Q.Q8_0:
        q = torch.randint(-127, 128, (n, nb, QK), generator=g)
        q[..., 3], q[..., 20] = -127, 127
        w = d.float()[..., None] * q.float()
        body = q.to(torch.int8).view(torch.uint8)
        raw = torch.cat([d[..., None].view(torch.uint8), body], -1)
    else:
        q = torch.randint(0, 16, (n, nb, QK), generator=g)
        q[..., 0], q[..., 31] = 0, 15
        packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        parts = [d[..., None].view(torch.uint8)]
        if qtype == Q.Q4_0:
            w = d.float()[..., None] * (q.float() - 8.0)
        else:
            m = (torch.randn(n, nb, generator=g) * 0.1).half()
            w = d.float()[..., None] * q.float() + m.float()[..., None]
            parts.append(m[..., None].view(torch.uint8))
        raw = torch.cat([*parts, packed], -1)
    return QuantBlocks(int(qtype), raw.reshape(n, -1).contiguous(), (n, kk)), w.view(n, kk)


def _activations(m: int, kk: int, seed: int) -> Activations:
    g = gen(seed)
    a = Activations(m, kk)
    a.q.copy_(torch.randint(-127, 128, (m, kk), generator=g).to(torch.int8))
    a.q[:, 0], a.q[:, 1] = 127, -127
    a.d.copy_(torch.rand(m, kk // QK, generator=g) * 0.05 + 0.001)
    a.s.copy_(a.d * a.q.float().view(m, kk // QK, QK).sum(-1))
    return a


def _assert_matmul(got: torch.Tensor, a: Activations, w: torch.Tensor, extra: torch.Tensor) -> None:
    """``got`` == x @ w.T + extra up to fp32 accumulation: 1e-5 of the sum of |terms|."""
    x = (a.q.double().view(a.rows, -1, QK) * a.d.double()[..., None]).view(a.rows, a.width)
    want = x @ w.double().T + extra.double()
    magnitude = x.abs() @ w.double().abs().T + 1e-3
    err = (got.double() - want).abs() / magnitude
    assert err.max().item() < 1e-5, f"relative error {err.max().item():.3g}"


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("qtype", [*FORMATS, *HALVES])
def test_gemm_on_grid_equals_float_math(k: Kernels, qtype: Q, m: int) -> None:
    n, kk = 40, 256
    blocks, w = _grid(qtype, n, kk, seed=m + 10 * int(qtype))
    assert torch.equal(dequantize_blocks(blocks), w)
    bias = torch.randn(n, generator=gen(m))
    linear = PackedLinear(blocks, bias)
    assert linear.type == pack_blocks(blocks)[0]
    a = _activations(m, kk, seed=100 + m)
    y = torch.full((m, n), float("nan"))
    linear(k, a, y)
    _assert_matmul(y, a, w, bias.expand(m, n))
    start = torch.randn(m, n, generator=gen(m + 1)) * 10
    y = start.clone()
    linear(k, a, y, accumulate=True)
    _assert_matmul(y, a, w, bias + start)


@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_1, Q.Q5_K, Q.Q6_K])
def test_int8_formats_row_by_row_and_interleaved(k: Kernels, qtype: Q, m: int) -> None:
    """Eight rows interleaved when N % 8 == 0, else row by row: the same products."""
    for n in (36, 48):
        blocks, w = _grid(qtype, n, 256, seed=m + n)
        linear = PackedLinear(blocks, None)
        assert bool(linear.layout & X8) == (n % 8 == 0)
        a = _activations(m, 256, seed=200 + m)
        y = torch.full((m, n), float("nan"))
        linear(k, a, y)
        _assert_matmul(y, a, w, torch.zeros(m, n))


def test_gemm_q4_0_entry_point(k: Kernels) -> None:
    m, n, kk = 5, 16, 64
    blocks, w = _grid(Q.Q4_0, n, kk, seed=3)
    _, nibbles, d, _ = pack_blocks(blocks)
    a = _activations(m, kk, seed=4)
    y = torch.full((m, n), float("nan"))
    k.lib.sl_gemm_q4_0(
        m, n, kk, a.q.data_ptr(), a.d.data_ptr(), a.s.data_ptr(), nibbles.data_ptr(),
        d.data_ptr(), 0, y.data_ptr(), 0, k.threads(),
    )  # fmt: skip
    _assert_matmul(y, a, w, torch.zeros(m, n))


# ---- the ABI: warnings, struct sizes ----------------------------------------------------------


def test_native_build_has_no_warnings(tmp_path: Path) -> None:
    build(flags=[*FLAGS, "-Werror"], directory=tmp_path)  # FLAGS has -Wall -Wextra ...


def test_struct_sizes_match_their_ctypes_mirrors(k: Kernels) -> None:
    for name, mirror in MIRRORS.items():
        assert k.lib.sl_sizeof(name.encode()) == ctypes.sizeof(mirror), name
    assert k.lib.sl_sizeof(b"sl_nothing") == -1
    assert [ctypes.sizeof(m) for m in (BlockQ4_0, BlockQ4_1, BlockQ8_0)] == [18, 20, 34]


def test_a_mirror_of_the_wrong_size_fails_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    class Short(ctypes.Structure):
        _fields_ = [("q", ctypes.c_void_p)]

    monkeypatch.setitem(MIRRORS, "sl_linear", Short)
    with pytest.raises(RuntimeError, match="sl_linear is 56 bytes"):
        Kernels(build())


# ---- tiny models written as each format -------------------------------------------------------


def _logits(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits of two ragged prompts in two slots, then one decode step of both rows."""
    cache = model_cache(model, slots=2)
    rows = [prefill_logits(model, prompts[0], cache=cache)]
    batch = build_batch([1], [0], len(prompts[1]), torch.device("cpu"))
    with torch.inference_mode():
        rows.append(model(torch.tensor([prompts[1]]), batch, cache, len(prompts[1]))[0])
        lengths = [len(ids) for ids in prompts]
        cache.reserve(max(lengths) + 1)
        batch = build_batch([0, 1], lengths, 1, torch.device("cpu"))
        return torch.cat(rows), model(torch.tensor([[5], [17]]), batch, cache)[:, 0]


# the kernel format each type written by gguf-py is packed into
KERNEL_FORMAT = {Q.Q4_0: Q.Q4_0, Q.Q4_1: Q.Q4_1, Q.Q8_0: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.Q5_1: Q8_M}


@pytest.mark.parametrize("qtype", list(KERNEL_FORMAT))
@pytest.mark.parametrize("arch", sorted(ARCH_MODEL_TYPE))
def test_tiny_model_in_each_format_tracks_the_dense_model(
    k: Kernels, tmp_path: Path, arch: str, qtype: Q
) -> None:
    tk = tiny_tokenizer(380)  # 384 tokens: the head splits into groups of eight rows too
    model = random_model(arch, tk.get_vocab_size(), seed=21)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tk, ARCH_MODEL_TYPE[arch], qtype)
    dense = load_model(str(path), device="cpu", dtype="float32").model
    loaded, _, _, file = load_gguf(path, "m")
    quantized = QuantizedLlama(loaded, k, file)
    linears = [quantized.head] + [
        lin for b in quantized.blocks for lin in (b.qkv, b.o_proj, b.gate_up, b.down)
    ]
    # every one packed from the file's blocks
    assert {lin.type for lin in linears} == {int(KERNEL_FORMAT[qtype])}
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    for got, want in zip(_logits(quantized, prompts), _logits(dense, prompts), strict=True):
        assert got.shape == want.shape
        # The tolerance of the Q4_1 tests: 8-bit activations are the only loss.
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_types_without_a_kernel_still_load_and_the_paths_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("no vectorized CPU kernels here")
    tk = tiny_tokenizer(380)
    model = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=22)
    weights = hf_state_dict(model)
    v = weights["model.layers.0.self_attn.v_proj.weight"].numpy()
    down = weights["model.layers.1.mlp.down_proj.weight"].numpy()
    override = {"blk.0.attn_v.weight": (gguf.quants.quantize(v, Q.Q5_0), Q.Q5_0)}
    override["blk.1.ffn_down.weight"] = (down.astype(np.float16), Q.F16)
    path = tmp_path / "mixed.gguf"
    write_gguf(path, model, tk, qtype=Q.Q4_0, tensor_override=override)
    with caplog.at_level(logging.INFO):
        auto = load_model(str(path), device="cpu")
    assert isinstance(auto.model, QuantizedLlama)
    # No dense fp32 copy of what the kernels read from blocks: meta placeholders, embeddings
    # looked up from the file's Q4_0 rows; the F16 down projection loaded dense, then freed.
    layers = auto.model.model.layers
    assert layers[0].self_attn.qkv.weight.is_meta and layers[1].mlp.gate_up.weight.is_meta
    assert auto.model.embeddings is not None and auto.model.model.embed_tokens.weight.is_meta
    assert (
        layers[1].mlp.down_proj.weight.numel() == 0 and not layers[1].mlp.down_proj.weight.is_meta
    )
    blocks = auto.model.blocks
    assert blocks[0].qkv.fmt == "q8_0"  # Q4_0 q and k with a Q5_0 v: re-quantized as Q8_0
    assert blocks[1].qkv.fmt == "q4_0" and blocks[1].down.fmt == "q8_0"
    logged = [r.getMessage() for r in caplog.records if "weights by type" in r.getMessage()]
    assert len(logged) == 1
    assert "Q4_0 x" in logged[0] and "Q4_0 kernel on the file's blocks" in logged[0]
    assert "Q5_0 x1: dequantized, re-quantized as Q8_0" in logged[0]
    assert "F16 x1: dequantized, re-quantized as Q8_0" in logged[0]


def test_eight_bit_gguf_runs_on_the_kernels_by_default(tmp_path: Path) -> None:
    tk = tiny_tokenizer()
    model = random_model("Qwen2ForCausalLM", tk.get_vocab_size(), seed=23)
    write_gguf(tmp_path / "q8.gguf", model, tk, "qwen2", Q.Q8_0)
    auto = load_model(str(tmp_path / "q8.gguf"), device="cpu")
    off = load_model(str(tmp_path / "q8.gguf"), device="cpu", cpu_kernels=False)
    k = kernels.load()
    if k is not None and k.vectorized:
        assert isinstance(auto.model, QuantizedLlama)
        assert auto.model.blocks[0].gate_up.fmt == "q8_0"
    # Without the kernels an 8-bit file stays dense: torch's int4 kernels would lose precision.
    assert isinstance(off.model.layers[0].mlp.gate_up, torch.nn.Linear)


# 256-wide layers: K-quant super-blocks span 256 inputs.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.mark.parametrize("arch", sorted(ARCH_MODEL_TYPE))
def test_tiny_q4_k_model_tracks_the_dense_model(k: Kernels, tmp_path: Path, arch: str) -> None:
    tk = tiny_tokenizer(380)
    model = random_model(arch, tk.get_vocab_size(), seed=24, **WIDE)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tk, ARCH_MODEL_TYPE[arch], Q.Q4_K)
    dense = load_model(str(path), device="cpu", dtype="float32").model
    loaded, _, _, file = load_gguf(path, "m")
    quantized = QuantizedLlama(loaded, k, file)
    assert {b.gate_up.fmt for b in quantized.blocks} == {"q4_1"} and quantized.head.fmt == "q4_1"
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    for got, want in zip(_logits(quantized, prompts), _logits(dense, prompts), strict=True):
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_q4_k_m_mix_runs_on_the_kernels(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A Q4_K_M file: Q4_K, with Q6_K attn_v and ffn_down, and one Q5_K (random blocks: the
    comparison is with the same file loaded dense)."""
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("no vectorized CPU kernels here")
    tk = tiny_tokenizer(380)
    model = random_model("Qwen2ForCausalLM", tk.get_vocab_size(), seed=25, **WIDE)
    override = {}
    shapes = {"blk.0.attn_v.weight": (128, 256), "blk.1.ffn_down.weight": (256, 512)}
    for name, (rows, cols) in shapes.items():
        override[name] = (_random_blocks(Q.Q6_K, rows, cols, seed=rows).data.numpy(), Q.Q6_K)
    # and one Q5_K (a Q5_K_M file's blocks)
    override["blk.0.ffn_down.weight"] = (_random_blocks(Q.Q5_K, 256, 512, 5).data.numpy(), Q.Q5_K)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, tk, "qwen2", Q.Q4_K, tensor_override=override)
    dense = load_model(str(path), device="cpu", dtype="float32").model
    with caplog.at_level(logging.INFO):
        auto = load_model(str(path), device="cpu").model
    assert isinstance(auto, QuantizedLlama)
    # Q4_K q and k fused with a Q6_K v: one format for the linear, re-quantized as Q8_0
    assert auto.blocks[0].qkv.fmt == "q8_0"
    assert auto.blocks[1].down.fmt == "q8_16" and auto.blocks[0].down.fmt == "q8_m"
    assert auto.blocks[1].qkv.fmt == "q4_1" and auto.blocks[0].gate_up.fmt == "q4_1"
    logged = next(r.getMessage() for r in caplog.records if "weights by type" in r.getMessage())
    assert "Q4_K x" in logged and "Q4_1 kernel on the file's blocks" in logged
    assert "Q6_K x1: Q8_16 kernel on the file's blocks" in logged
    assert "Q6_K x1: dequantized, re-quantized as Q8_0" in logged
    assert "Q5_K x1: Q8_M kernel on the file's blocks" in logged
    prompts = [tk.encode("The capital of France is Paris.").ids, tk.encode("Hello world!").ids]
    for got, want in zip(_logits(auto, prompts), _logits(dense, prompts), strict=True):
        assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_lazy_load_still_rejects_non_finite_blocks(tmp_path: Path) -> None:
    k = kernels.load()
    if k is None or not k.vectorized:
        pytest.skip("no vectorized CPU kernels here")
    tk = tiny_tokenizer(380)
    model = random_model("LlamaForCausalLM", tk.get_vocab_size(), seed=27)
    bad = gguf.quants.quantize(
        hf_state_dict(model)["model.layers.1.mlp.up_proj.weight"].numpy(), Q.Q8_0
    )
    bad[3, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # a block's f16 scale
    path = tmp_path / "nan.gguf"
    write_gguf(
        path, model, tk, qtype=Q.Q8_0, tensor_override={"blk.1.ffn_up.weight": (bad, Q.Q8_0)}
    )
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight holds NaN or infinite"):
        load_model(str(path), device="cpu")
