"""sluice's CPU kernels (``matmul.c``, ``q8.c``, ``amx.c``, ``attention.c``, ``forward.c``): built
on first use, loaded with ctypes.

Owns compiling the C files with the machine's C compiler (``-O3 -march=native -fopenmp``) into a
cache directory, loading the library, and stating its ABI on the Python side. Knows nothing about
models: ``services.worker.models.kernel_llama`` decides what to call.

The ABI is ``sluice_cpu.h``, which declares every exported function and struct (``sl_impl.h``
holds what the C files share and nothing exported). Its Python side is kept here, so a change to
the header has one place to follow: ``SIGNATURES`` (every exported function's argument types,
set as ctypes ``argtypes`` at load, so a wrong argument count fails loudly) and the
``ctypes.Structure`` mirrors of the header's structs (``MIRRORS``: the GGUF block structs and
``Linear``, ``Layer``, ``Model``, ``Scratch``), whose sizes are compared with the library's
``sl_sizeof`` at load (the C side asserts them statically). The activation kernels have typed
methods on ``Kernels`` that take tensors; the GEMMs and the whole forward step are called directly
as ``Kernels.lib.sl_*`` by the quantized model, which owns their buffers.

The instruction set is chosen at build time from the compiler's target: ``-march=native``
defines ``__AVX512VNNI__`` etc. on a CPU that has them, and the C picks AVX-512 VNNI, AVX2 + FMA
or its generic loops (``Kernels.isa`` says which); with AVX-512 VNNI, AMX int8 tiles too for
prefill GEMMs where the CPU has them and the OS grants the tile state at load (``amx.c``; the
ISA then reads ``avx512vnni+amx``; ``-DSL_NO_AMX`` builds without). The tests also build the
portable scalar variant and an AVX2-only one and compare all of them to float64 references.

Why ctypes and plain C rather than a torch extension: the files build in about two seconds
with no torch headers, and a call costs a couple of microseconds. The library links the same
``libgomp`` torch already loaded, so both share one OpenMP pool.

The build is keyed by the source, the flags and the CPU's feature flags, so a cache directory
shared between machines never serves a binary built for another CPU. ``SLUICE_KERNEL_DIR`` moves
the cache (the worker image points it at /tmp; the build runs at worker start, for the CPU it
runs on). No compiler, or a failed build:
``load()`` returns None and logs why, and the engine falls back to torch's own int4 kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from ctypes import c_float, c_int, c_int64, c_void_p
from pathlib import Path

import torch

__all__ = [
    "MIRRORS",
    "QK",
    "Activations",
    "BlockQ4K",
    "BlockQ4_0",
    "BlockQ4_1",
    "BlockQ8_0",
    "Kernels",
    "Layer",
    "Linear",
    "Model",
    "Scratch",
    "build",
    "load",
]

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / f for f in ("matmul.c", "q8.c", "amx.c", "attention.c", "forward.c")]
HEADERS = [HERE / "sluice_cpu.h", HERE / "sl_impl.h"]  # the ABI, and what the sources share
WARNINGS = ["-Wall", "-Wextra", "-Wmissing-prototypes"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", *WARNINGS]

_P, _I, _F = c_void_p, c_int64, c_float
SIGNATURES: dict[str, list[type]] = {
    "sl_vectorized": [],
    "sl_isa": [],
    "sl_sizeof": [ctypes.c_char_p],
    "sl_quantize": [_P, _I, _I, _P, _P, _P, c_int],
    "sl_rmsnorm_quantize": [_P, _P, _F, _I, _I, _P, _P, _P, _P, c_int],
    "sl_swiglu_quantize": [_P, _I, _I, _P, _P, _P, _P, c_int],
    "sl_gemm_q4_1": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, c_int, c_int],
    "sl_gemm_q8_0": [_I, _I, _I, _P, _P, _P, _P, _P, _P, c_int, c_int],
    "sl_gemm_q4_0": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _P, c_int, c_int],
    "sl_linear_forward": [_P, _I, _P, _P, _P, _P, c_int, c_int],
    "sl_attention": [
        *(_I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _F, _P, _P, _I, c_int)
    ],
    "sl_forward": [_P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I, c_int],
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
    as ggml numbers them, 64 Q8_M, 65 Q8_16)."""

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
        ("scores", _P),
    ]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def default_dir() -> Path:
    """Where builds are cached unless ``SLUICE_KERNEL_DIR`` (``Settings.kernel_dir``) says."""
    return Path.home() / ".cache" / "sluice" / "kernels"


def _library_path(flags: list[str], directory: Path) -> Path:
    key = hashlib.sha256()
    for path in (*HEADERS, *SOURCES):
        key.update(path.read_bytes())
    for part in (" ".join(flags).encode(), platform.machine().encode()):
        key.update(part)
    key.update(_cpu_flags().encode())
    return directory / f"sluice_cpu-{key.hexdigest()[:16]}.so"


def build(flags: list[str] | None = None, directory: Path | None = None) -> Path:
    """Compile the library into the cache (no-op when it is there); return its path.

    ``flags`` replaces ``FLAGS`` (the tests build the portable scalar variant without
    ``-march=native``); ``directory`` replaces the cache directory.

    Raises:
        RuntimeError: no C compiler, or it failed (its output is in the message).
    """
    flags = FLAGS if flags is None else flags
    target = _library_path(flags, directory or default_dir())
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two workers starting together never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:  # the compiler named by CC cannot be run
        Path(tmp).unlink(missing_ok=True)
        raise RuntimeError(f"cannot run the C compiler {cc!r}: {exc}") from exc
    if done.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
    os.replace(tmp, target)
    return target


QK = 32  # values per quantization block


class Activations:
    """Rows quantized for a matmul: int8 values, per-block scales and scaled sums, plus the
    fused kernels' fp32 scratch. Sized for ``width``; a use with K <= width packs rows at
    stride K."""

    def __init__(self, rows: int, width: int) -> None:
        self.q = torch.empty(rows, width, dtype=torch.int8)
        self.d = torch.empty(rows, width // QK)
        self.s = torch.empty(rows, width // QK)
        self.tmp = torch.empty(rows, width)
        self.rows, self.width = rows, width


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
_RESTYPES: dict[str, type] = {
    "sl_vectorized": c_int,
    "sl_isa": ctypes.c_char_p,
    "sl_sizeof": c_int64,
}


class Kernels:
    """The loaded library (``lib``, argtypes set from ``SIGNATURES``) and typed methods for the
    activation kernels, which pass tensors by address (no copies, no checks beyond what the
    callers' shapes already guarantee).

    Raises:
        RuntimeError: a struct's size differs from its ctypes mirror (the header and
            ``MIRRORS`` disagree: calls would read garbage).
    """

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = _RESTYPES.get(name)
        for name, mirror in MIRRORS.items():
            size = self.lib.sl_sizeof(name.encode())
            if size != ctypes.sizeof(mirror):
                raise RuntimeError(
                    f"{path.name}: {name} is {size} bytes, its ctypes mirror "
                    f"{mirror.__name__} {ctypes.sizeof(mirror)}"
                )
        self.vectorized = bool(self.lib.sl_vectorized())
        self.isa: str = self.lib.sl_isa().decode()  # avx512vnni(+amx), avx2+vnni, avx2 or scalar
        self.prefill_threads = 0  # SLUICE_PREFILL_THREADS (0: threads())

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()

    def forward_threads(self, tokens_per_row: int) -> int:
        """Threads for a forward of ``tokens_per_row`` new tokens per sequence: a prompt chunk
        (more than one) may take ``prefill_threads``. Where the API shares the cores (``sluice
        up`` keeps one for it during decode), nothing streams while a prompt is read, so the
        chunk can have every core; logits do not depend on the thread count (forward.c)."""
        if tokens_per_row > 1 and self.prefill_threads > 0:
            return self.prefill_threads
        return self.threads()

    def quantize(self, x: torch.Tensor, out: Activations) -> None:
        """Quantize rows of ``x`` (M, K) fp32, M == out.rows."""
        m, k = x.shape
        self.lib.sl_quantize(
            x.data_ptr(), m, k, out.q.data_ptr(), out.d.data_ptr(), out.s.data_ptr(), self.threads()
        )

    def rmsnorm_quantize(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: Activations
    ) -> None:
        """Quantize ``RMSNorm(x) * weight`` for rows of ``x`` (M, K) fp32."""
        m, k = x.shape
        self.lib.sl_rmsnorm_quantize(
            x.data_ptr(), weight.data_ptr(), eps, m, k, out.q.data_ptr(), out.d.data_ptr(),
            out.s.data_ptr(), out.tmp.data_ptr(), self.threads(),
        )  # fmt: skip

    def swiglu_quantize(self, gate_up: torch.Tensor, out: Activations) -> None:
        """Quantize ``silu(gate) * up`` for rows of ``gate_up`` (M, 2 I) fp32."""
        m, two_i = gate_up.shape
        self.lib.sl_swiglu_quantize(
            gate_up.data_ptr(), m, two_i // 2, out.q.data_ptr(), out.d.data_ptr(),
            out.s.data_ptr(), out.tmp.data_ptr(), self.threads(),
        )  # fmt: skip


_loaded: Kernels | None = None
_tried = False
_lock = threading.Lock()


def load(directory: Path | None = None) -> Kernels | None:
    """The kernels, built (into ``directory``, default ``default_dir()``) and loaded once per
    process; None when they cannot be built here."""
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = Kernels(build(directory=directory))
                log.info("sluice CPU kernels: %s", _loaded.isa)
            except (OSError, RuntimeError) as exc:
                log.warning("sluice CPU kernels unavailable, using torch's int4 kernels: %s", exc)
        return _loaded
