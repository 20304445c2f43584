"""The Python side of the kernels' ABI (``sluice_cpu.h``): one place to follow a header change.

``SIGNATURES`` holds every exported function's argument types (set as ctypes ``argtypes`` at
load, so a wrong argument count fails loudly) and ``RESTYPES`` the non-void returns; the
``ctypes.Structure`` classes mirror the header's structs (``MIRRORS``: the GGUF block structs and
``Linear``, ``Layer``, ``Model``, ``Scratch``), whose sizes ``Kernels`` compares with the
library's ``sl_sizeof`` at load (the C side asserts them statically).
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p

__all__ = [
    "MIRRORS",
    "RESTYPES",
    "SIGNATURES",
    "BlockQ4K",
    "BlockQ4_0",
    "BlockQ4_1",
    "BlockQ5K",
    "BlockQ5_0",
    "BlockQ5_1",
    "BlockQ6K",
    "BlockQ8_0",
    "Layer",
    "Linear",
    "Model",
    "Scratch",
]

_P, _I, _F = c_void_p, c_int64, c_float
SIGNATURES: dict[str, list[type]] = {
    "sl_vectorized": [],
    "sl_isa": [],
    "sl_set_narrow_rows": [c_int],
    "sl_sizeof": [ctypes.c_char_p],
    "sl_quantize": [_P, _I, _I, _P, _P, _P, c_int],
    "sl_rmsnorm_quantize": [_P, _P, _F, _I, _I, _P, _P, _P, _P, c_int],
    "sl_swiglu_quantize": [_P, _I, _I, _P, _P, _P, _P, c_int],
    "sl_gemm_q4_1": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, c_int, c_int],
    "sl_gemm_q8_0": [_I, _I, _I, _P, _P, _P, _P, _P, _P, c_int, c_int],
    "sl_gemm_q4_0": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, c_int, c_int],
    "sl_linear_forward": [_P, _I, _P, _P, _P, _P, c_int, c_int],
    # n, H, KV, hd, qkv, cos, sin, pos, seq, tables, table_stride, block_size, num_blocks, kc,
    # vc, q_norm, k_norm, eps, out, span, nthreads
    "sl_attention": [
        *(_I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _P, _F, _P, _I),
        c_int,
    ],
    # model, n, x, pos, seq, tables, table_stride, block_size, kc, vc, num_blocks, span, scratch,
    # logits, logit_rows, n_logits, nthreads
    "sl_forward": [_P, _I, _P, _P, _P, _P, _I, _I, _P, _P, _I, _I, _P, _P, _P, _I, c_int],
}


class BlockQ4_0(ctypes.Structure):
    """``sl_block_q4_0``: a GGUF Q4_0 block (f16 scale, 16 bytes of nibbles)."""

    _fields_ = [("d", ctypes.c_uint16), ("qs", ctypes.c_uint8 * 16)]


class BlockQ4_1(ctypes.Structure):
    """``sl_block_q4_1``: a GGUF Q4_1 block (f16 scale and minimum, 16 bytes of nibbles)."""

    _fields_ = [("d", ctypes.c_uint16), ("m", ctypes.c_uint16), ("qs", ctypes.c_uint8 * 16)]


class BlockQ8_0(ctypes.Structure):
    """``sl_block_q8_0``: a GGUF Q8_0 block (f16 scale, 32 int8 values)."""

    _fields_ = [("d", ctypes.c_uint16), ("qs", ctypes.c_int8 * 32)]


class BlockQ5_0(ctypes.Structure):
    """``sl_block_q5_0``: a GGUF Q5_0 block (f16 scale, 32 fifth bits, 16 bytes of nibbles)."""

    _fields_ = [("d", ctypes.c_uint16), ("qh", ctypes.c_uint8 * 4), ("qs", ctypes.c_uint8 * 16)]


class BlockQ5_1(ctypes.Structure):
    """``sl_block_q5_1``: a GGUF Q5_1 block (Q5_0 with an f16 minimum)."""

    _fields_ = [
        ("d", ctypes.c_uint16),
        ("m", ctypes.c_uint16),
        ("qh", ctypes.c_uint8 * 4),
        ("qs", ctypes.c_uint8 * 16),
    ]


class BlockQ5K(ctypes.Structure):
    """``sl_block_q5_K``: a GGUF Q5_K super-block (Q4_K plus 32 bytes of fifth bits)."""

    _fields_ = [
        ("d", ctypes.c_uint16),
        ("dmin", ctypes.c_uint16),
        ("scales", ctypes.c_uint8 * 12),
        ("qh", ctypes.c_uint8 * 32),
        ("qs", ctypes.c_uint8 * 128),
    ]


class BlockQ6K(ctypes.Structure):
    """``sl_block_q6_K``: a GGUF Q6_K super-block (low nibbles, high bit pairs, int8 scale per
    16 values, f16 scale)."""

    _fields_ = [
        ("ql", ctypes.c_uint8 * 128),
        ("qh", ctypes.c_uint8 * 64),
        ("scales", ctypes.c_int8 * 16),
        ("d", ctypes.c_uint16),
    ]


class BlockQ4K(ctypes.Structure):
    """``sl_block_q4_K``: a GGUF Q4_K super-block of 256 values (f16 d and dmin, 12 bytes of
    6-bit scales and minimums, 128 bytes of nibbles)."""

    _fields_ = [
        ("d", ctypes.c_uint16),
        ("dmin", ctypes.c_uint16),
        ("scales", ctypes.c_uint8 * 12),
        ("qs", ctypes.c_uint8 * 128),
    ]


class Linear(ctypes.Structure):
    """``sl_linear``: a packed linear's buffers and its format (``SL_*``: 2 Q4_0, 3 Q4_1, 8 Q8_0
    as ggml numbers them, 64 Q8_M, 65 Q8_16, 66 Q5_M; | 256 SL_X8 for int8 rows interleaved,
    | 512 SL_H16 for scales and minimums held as halves)."""

    _fields_ = [
        ("q", _P),
        ("d", _P),
        ("m", _P),
        ("bias", _P),
        ("n", _I),
        ("k", _I),
        ("type", _I),
    ]


class Layer(ctypes.Structure):
    """``sl_layer``: one block's norms and linears."""

    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("qkv", Linear),
        ("o", Linear),
        ("gate_up", Linear),
        ("down", Linear),
    ]


class Model(ctypes.Structure):
    """``sl_model``: shapes, RoPE tables, layers and the head."""

    _fields_ = [
        ("layers", _I),
        ("hidden", _I),
        ("inner", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("eps", _F),
        ("cos", _P),
        ("sin", _P),
        ("final_norm", _P),
        ("layer", ctypes.POINTER(Layer)),
        ("head", Linear),
    ]


class Scratch(ctypes.Structure):
    """``sl_scratch``: one step's buffers."""

    _fields_ = [
        ("xq", _P),
        ("xd", _P),
        ("xs", _P),
        ("tmp", _P),
        ("qkv", _P),
        ("attended", _P),
        ("gate_up", _P),
    ]


# Every struct of the ABI and its ctypes mirror: their sizes are compared at load.
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "sl_block_q4_0": BlockQ4_0,
    "sl_block_q4_1": BlockQ4_1,
    "sl_block_q8_0": BlockQ8_0,
    "sl_block_q5_0": BlockQ5_0,
    "sl_block_q5_1": BlockQ5_1,
    "sl_block_q4_K": BlockQ4K,
    "sl_block_q5_K": BlockQ5K,
    "sl_block_q6_K": BlockQ6K,
    "sl_linear": Linear,
    "sl_layer": Layer,
    "sl_model": Model,
    "sl_scratch": Scratch,
}
RESTYPES: dict[str, type] = {
    "sl_vectorized": c_int,
    "sl_isa": ctypes.c_char_p,
    "sl_sizeof": c_int64,
}
