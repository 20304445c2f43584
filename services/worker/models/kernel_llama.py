"""A Llama-family model's forward on sluice's CPU kernels (GGUF Q4/Q5/Q6/Q8 blocks).

Owns packing a loaded ``LlamaModel``'s linears into the kernels' block formats and
``QuantizedLlama``, which runs a decode step (one new token per row) as one call into
``services.worker.kernels`` instead of ~1,500 torch ops. The math is the model's own (same
RMSNorm, RoPE convention, GQA, SwiGLU, KV-cache layout), with activations quantized to 8 bits per
32 values before each matmul, so tests compare the two paths step by step.

Prefill (many tokens per row) is the same call as decode (``sl_forward``): the same GEMMs (the
interleaved Q4 GEMM beats oneDNN's fp32 GEMM by ~1.5x at prefill sizes on AVX2), RoPE from the
same table and the same attention routine, each query over exactly its keys 0..pos. So greedy
output does not depend on prefix-cache hits, prefill chunking, batch composition or a failover's
re-prefill of generated tokens (README, Determinism). The dense linears are freed.

Where each linear comes from (``Packer``): a GGUF file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K and Q6_K blocks are packed exactly (``models.blocks``: the 4-bit ones into the interleaved
Q4 layouts, the 5-, 6- and 8-bit ones into int8 layouts), and the token embeddings are looked up
from the file's blocks; a fused linear whose parts differ in type is packed exactly into one int8
layout where one holds them all (``QuantBlocks.cat``). Any other type (F16, Q3_K, IQ*) and other
mixes are re-quantized from dense weights: as Q4_1 when every part was 4-bit, as Q8_0 (near
lossless) otherwise. Without a file (``dtype=int4``, an fp32 model) the blocks are Q4_1 and the
head Q8_0. The path each tensor type took is logged once per load.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from services.worker.host_memory import on_huge_pages
from services.worker.kernels import QK, Activations, Kernels, Layer, Linear, Model, Scratch
from services.worker.kv_cache import AttentionBatch, PagedKVCache
from services.worker.models.blocks import (
    FOUR_BIT_TYPES,
    H16,
    HALF_LAYOUTS,
    INTERLEAVED,
    Q4_0,
    Q4_1,
    Q5_M,
    Q8_0,
    Q8_M,
    X8,
    FileWeights,
    QuantBlocks,
    as_halves,
    dequantize_blocks,
    interleave_q8,
    pack_blocks,
    pack_q5_m,
    type_name,
)
from services.worker.models.llama import Attention, Block, LlamaConfig, LlamaModel
from services.worker.models.requantize import pack_q4_1, pack_q8_0, unpack_q4_1

__all__ = [
    "FORMATS",
    "Activations",
    "PackedLinear",
    "QuantizedLlama",
    "fits",
    "pack_q4_1",
    "pack_q8_0",
    "supports",
    "unpack_q4_1",
]


log = logging.getLogger(__name__)

FORMATS = {"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0}  # the kernels' weight formats


def fits(cfg: LlamaConfig) -> bool:
    """Whether every block matmul's inputs split into 32-value blocks and its outputs into
    groups of eight rows."""
    widths = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    outputs = (cfg.hidden_size, 2 * cfg.intermediate_size, (cfg.num_heads + 2 * cfg.num_kv_heads))
    return (
        all(w % QK == 0 for w in widths)
        and all(o % 8 == 0 for o in outputs[:2])
        and outputs[2] * cfg.head_dim % 8 == 0
    )


def supports(model: nn.Module) -> bool:
    """Whether the kernels fit ``model``: fp32 on CPU (its norms: the weights may be meta
    placeholders for blocks, ``FileWeights.lazy``) and widths that ``fits``."""
    if not isinstance(model, LlamaModel):
        return False
    weight = model.norm.weight
    return fits(model.config) and weight.device.type == "cpu" and weight.dtype == torch.float32


class PackedLinear:
    """``y (+)= x @ W.T + b`` on packed blocks, in any format a kernel reads (``FORMATS``):
    packed from a file's blocks as they are, or re-quantized from dense weights (``fmt``:
    ``q4_1`` or ``q8_0``)."""

    def __init__(
        self, weight: torch.Tensor | QuantBlocks, bias: torch.Tensor | None, fmt: str = "q4_1"
    ) -> None:
        self.out_features, self.in_features = weight.shape
        m: torch.Tensor | None = None
        if isinstance(weight, QuantBlocks):
            self.type, self.q, self.d, m = pack_blocks(weight)
            if self.type == Q8_M and self.out_features % 8 == 0:  # the same values, 5 bits each
                assert m is not None
                self.type = Q5_M
                self.q, self.d, m = pack_q5_m(self.q, self.d, m)
                if torch.equal(m, -16.0 * self.d):  # Q5_0's: the kernels imply them, as Q4_0's
                    m = None
        elif fmt == "q4_1":
            self.type = FORMATS[fmt]
            self.q, self.d, m = pack_q4_1(weight)
        else:
            self.type = FORMATS[fmt]
            self.q, self.d = pack_q8_0(weight)
        self.fmt = type_name(self.type).lower()
        self.layout = self.type  # sl_linear.type: the format, | X8 when its rows are interleaved
        if self.type not in (*INTERLEAVED, Q5_M) and self.out_features % 8 == 0:
            self.layout |= X8
            self.q, self.d, m = interleave_q8(self.type, self.q, self.d, m)
        halves = as_halves(self.d, m) if self.layout in HALF_LAYOUTS else None
        if halves is not None:  # | H16: the scales (and minimums) are halves
            self.layout |= H16
            self.d, m = halves
        self.m = m  # minimums (Q4_1, Q8_M, Q5_M); the other formats have none
        # every step streams these: on 2 MB pages, a TLB entry covers 512x the bytes
        self.q, self.d = on_huge_pages(self.q), on_huge_pages(self.d)
        self.m = None if m is None else on_huge_pages(m)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.view = self.struct()  # one struct for every call (its buffers live as long as self)

    def struct(self) -> Linear:
        """The kernels' view of this linear (the tensors must outlive it)."""
        return Linear(
            self.q.data_ptr(),
            self.d.data_ptr(),
            _ptr(self.m),
            _ptr(self.bias),
            self.out_features,
            self.in_features,
            self.layout,
        )

    def __call__(
        self, k: Kernels, x: Activations, y: torch.Tensor, *, accumulate: bool = False
    ) -> None:
        """Write (or add) the product for ``x``'s rows into ``y`` (rows, out_features) fp32."""
        k.lib.sl_linear_forward(
            ctypes.byref(self.view), x.rows, x.q.data_ptr(), x.d.data_ptr(), x.s.data_ptr(),
            y.data_ptr(), int(accumulate), k.threads(),
        )  # fmt: skip


class Packer:
    """Packs each linear from the best source and counts which path each tensor type took."""

    def __init__(self, file: FileWeights | None) -> None:
        self.file = file
        self.paths: Counter[tuple[str, str]] = Counter()

    def linear(
        self, weight: torch.Tensor, bias: torch.Tensor | None, names: list[str], dense: str
    ) -> PackedLinear:
        """The linear made of the file's tensors ``names`` (stacked by rows): from their blocks
        when a kernel reads them as they are, else from the dense ``weight`` re-quantized, as
        ``dense`` (no file: dtype int4 or an fp32 model) or, from a file, as Q4_1 when every
        part was 4-bit and Q8_0 (near lossless) otherwise."""
        if self.file is None:
            self.paths["dense", f"re-quantized as {dense.upper()}"] += len(names)
            return PackedLinear(weight, bias, dense)
        types = [type_name(self.file.types.get(n, 0)) for n in names]
        blocks = self.file.fused(names)
        if blocks is not None and (blocks.qtype not in INTERLEAVED or blocks.shape[0] % 8 == 0):
            linear = PackedLinear(blocks, bias)
            for t in types:
                self.paths[t, f"{linear.fmt.upper()} kernel on the file's blocks"] += 1
            return linear
        four = all(self.file.types.get(n) in FOUR_BIT_TYPES for n in names)
        fmt = "q4_1" if four and weight.shape[0] % 8 == 0 else "q8_0"  # Q4_1: groups of 8 rows
        if weight.is_meta:  # loaded lazily: every part has blocks (gguf._lazy_names)
            weight = torch.cat([dequantize_blocks(self.file.blocks[n]) for n in names])
        for t in types:
            self.paths[t, f"dequantized, re-quantized as {fmt.upper()}"] += 1
        return PackedLinear(weight, bias, fmt)

    def summary(self) -> str:
        return "; ".join(f"{t} x{n}: {path}" for (t, path), n in sorted(self.paths.items()))


@dataclass
class PackedBlock:
    """One transformer block's weights in the kernels' formats."""

    input_norm: torch.Tensor  # (C,)
    qkv: PackedLinear
    q_norm: torch.Tensor | None  # (hd,) Qwen3 only
    k_norm: torch.Tensor | None
    o_proj: PackedLinear
    post_norm: torch.Tensor  # (C,)
    gate_up: PackedLinear
    down: PackedLinear

    @classmethod
    def from_block(cls, block: Block, index: int, packer: Packer) -> PackedBlock:
        attn: Attention = block.self_attn
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        at = f"model.layers.{index}."

        def names(*parts: str) -> list[str]:
            return [f"{at}{p}.weight" for p in parts]

        qkv = names("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        o_proj, down = names("self_attn.o_proj"), names("mlp.down_proj")
        return cls(
            input_norm=block.input_layernorm.weight.detach().float().contiguous(),
            qkv=packer.linear(attn.qkv.weight, attn.qkv.bias, qkv, "q4_1"),
            q_norm=None if q_norm is None else q_norm.weight.detach().float().contiguous(),
            k_norm=None if k_norm is None else k_norm.weight.detach().float().contiguous(),
            o_proj=packer.linear(attn.o_proj.weight, attn.o_proj.bias, o_proj, "q4_1"),
            post_norm=block.post_attention_layernorm.weight.detach().float().contiguous(),
            gate_up=packer.linear(
                block.mlp.gate_up.weight, None, names("mlp.gate_proj", "mlp.up_proj"), "q4_1"
            ),
            down=packer.linear(block.mlp.down_proj.weight, None, down, "q4_1"),
        )

    def struct(self) -> Layer:
        """The kernels' view of this block (the tensors must outlive it)."""
        return Layer(
            self.input_norm.data_ptr(),
            self.post_norm.data_ptr(),
            _ptr(self.q_norm),
            _ptr(self.k_norm),
            self.qkv.view,
            self.o_proj.view,
            self.gate_up.view,
            self.down.view,
        )


class QuantizedLlama(nn.Module):
    """``LlamaModel``'s forward with decode steps on the CPU kernels (same signature)."""

    # attention.c reads keys and values 0..pos of each row, all written by this sequence or the
    # prefix it shares: a block need not be zero-filled (PagedKVCache ``zeroed``)
    reads_only_written_kv = True
    # attention.c keeps keys and values as IEEE halves, as llama.cpp's default cache does: one
    # stream's decode reads the whole cache every token, and at a few hundred tokens fp32 keys
    # and values were an eighth of the step's bytes (docs/benchmarks.md)
    kv_dtype = torch.float16

    def __init__(
        self, model: LlamaModel, kernels: Kernels, file: FileWeights | None = None
    ) -> None:
        """Pack ``model``'s linears (from ``file``'s blocks where a kernel reads them as they
        are) and free the dense ones; log once which path each tensor type took."""
        super().__init__()
        self.model = model  # embeddings and RoPE tables (its linears are freed below)
        self.config = cfg = model.config
        self.kernels = kernels
        layers = [cast(Block, b) for b in model.layers]
        packer = Packer(file)
        self.blocks = [PackedBlock.from_block(b, i, packer) for i, b in enumerate(layers)]
        self.final_norm = model.norm.weight.detach().float().contiguous()
        tied = file is None or "lm_head.weight" not in file.types
        head = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        self.head = packer.linear(model.lm_head.weight, model.lm_head.bias, head, "q8_0")
        log.info("CPU kernels, weights by type: %s", packer.summary())
        # Token embeddings from the file's blocks, a row per token dequantized when looked up
        # (as the loader would, bit for bit), instead of a dense fp32 table.
        self.embeddings = None if file is None else file.blocks.get("model.embed_tokens.weight")
        _release_dense(model, embeddings=self.embeddings is not None)  # after the packing above
        self.layer_structs = (Layer * len(self.blocks))(*(b.struct() for b in self.blocks))
        self.struct = Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            model.rope_cos.data_ptr(),  # (ctx, hd) fp32, contiguous, kept alive by self.model
            model.rope_sin.data_ptr(),
            self.final_norm.data_ptr(),
            self.layer_structs,
            self.head.view,
        )
        self.scratch: dict[int, tuple[Scratch, list[torch.Tensor]]] = {}
        # The widest matmul input: every quantized activation buffer is sized for it.
        self.act_width = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)

    def forward(
        self, idx: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """Logits (m, V) fp32 of the batch's ``logit_rows`` for token rows ``idx`` (n,): decode
        rows and prompt chunks of any sequences in one call to the kernels, through the same
        code, so a token's logits do not depend on which forward computed it (``sl_forward``)."""
        if cache.k.dtype != self.kv_dtype:  # the C side would read fp32 as pairs of halves
            raise TypeError(f"the kernels' KV cache holds {self.kv_dtype}, not {cache.k.dtype}")
        n = idx.shape[0]
        x = self.embed(idx)  # (n, C) residual stream
        wanted = batch.logit_rows.contiguous()
        logits = torch.empty(wanted.numel(), self.head.out_features)
        positions, seqs = batch.positions.contiguous(), batch.seq_index.contiguous()
        tables = batch.tables.contiguous()
        threads = self.kernels.forward_threads(max(s.count for s in batch.seqs))
        scratch, _buffers = self._scratch(n)  # alive until the call returns
        self.kernels.lib.sl_forward(
            ctypes.byref(self.struct), n, x.data_ptr(), positions.data_ptr(), seqs.data_ptr(),
            tables.data_ptr(), tables.shape[1], cache.block_size, cache.k.data_ptr(),
            cache.v.data_ptr(), cache.num_blocks, batch.span, ctypes.byref(scratch),
            logits.data_ptr(), wanted.data_ptr(), wanted.numel(), threads,
        )  # fmt: skip
        return logits

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) token ids -> (n, C) fp32 embeddings, contiguous."""
        if self.embeddings is None:
            return self.model.embed_tokens(ids).contiguous()
        table = self.embeddings
        rows = QuantBlocks(table.qtype, table.data[ids], (ids.shape[0], table.shape[1]))
        return dequantize_blocks(rows).contiguous()

    def _scratch(self, rows: int) -> tuple[Scratch, list[torch.Tensor]]:
        """Buffers for ``rows`` token rows: kept for decode batches (at most ``max_batch`` rows,
        reused every step), made afresh for a prefill chunk (its buffers are small beside its
        work, and chunk sizes vary). Attention keeps its own per-thread scratch in C."""
        cfg = self.config
        held = self.scratch.get(rows)
        if held is None:
            act = Activations(rows, self.act_width)
            tensors = [
                act.q,
                act.d,
                act.s,
                act.tmp,
                torch.empty(rows, self.blocks[0].qkv.out_features),
                torch.empty(rows, cfg.num_heads * cfg.head_dim),  # attended
                torch.empty(rows, 2 * cfg.intermediate_size),  # gate_up
            ]
            held = (Scratch(*(t.data_ptr() for t in tensors)), tensors)
            if rows <= KEPT_ROWS:
                self.scratch[rows] = held
        return held


KEPT_ROWS = 64  # decode batches (and chunks this small) keep their buffers between steps


def _release_dense(model: LlamaModel, *, embeddings: bool) -> None:
    """Free the fp32 weights the packed blocks replace (7/8 of a 4-bit model's memory), and the
    embedding table when ``embeddings`` (looked up from the file's blocks instead); the dense
    model keeps norms and RoPE tables, and can no longer run its own
    forward."""
    for layer in model.layers:
        block = cast(Block, layer)
        attn, mlp = block.self_attn, block.mlp
        for linear in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj):
            if not linear.weight.is_meta:  # a meta placeholder holds no memory
                linear.weight.data = torch.empty(0)
            if linear.bias is not None:
                linear.bias.data = torch.empty(0)
    if model.lm_head.weight is not model.embed_tokens.weight and not model.lm_head.weight.is_meta:
        model.lm_head.weight.data = torch.empty(0)
    if embeddings and not model.embed_tokens.weight.is_meta:
        model.embed_tokens.weight.data = torch.empty(0)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
