"""sluice's CPU kernels (``quantize.c``, ``matmul.c``, ``q8.c``, ``amx.c``, ``attend.c``,
``attention.c``, ``forward.c``): built on first use, loaded with ctypes.

Owns compiling the C files with the machine's C compiler (``-O3 -march=native -fopenmp``) into a
cache directory, loading the library, and stating its ABI on the Python side. Knows nothing about
models: ``services.worker.models.kernel_llama`` decides what to call.

The ABI is ``sluice_cpu.h``, which declares every exported function and struct (``sl_impl.h``
holds what the C files share and nothing exported); its Python side (argument types and struct
mirrors) is ``abi.py``, re-exported here. The activation kernels have typed
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
from pathlib import Path

import torch

from services.worker.kernels.abi import (
    MIRRORS,
    RESTYPES,
    SIGNATURES,
    BlockQ4_0,
    BlockQ4_1,
    BlockQ4K,
    BlockQ8_0,
    Layer,
    Linear,
    Model,
    Scratch,
)
from services.worker.kernels.tiles import tune_tiles

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
SOURCES = [
    HERE / f
    for f in ("quantize.c", "matmul.c", "q8.c", "amx.c", "attend.c", "attention.c", "forward.c")
]
HEADERS = [HERE / "sluice_cpu.h", HERE / "sl_impl.h"]  # the ABI, and what the sources share
WARNINGS = ["-Wall", "-Wextra", "-Wmissing-prototypes"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", *WARNINGS]


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
            fn.restype = RESTYPES.get(name)
        for name, mirror in MIRRORS.items():
            size = self.lib.sl_sizeof(name.encode())
            if size != ctypes.sizeof(mirror):
                raise RuntimeError(
                    f"{path.name}: {name} is {size} bytes, its ctypes mirror "
                    f"{mirror.__name__} {ctypes.sizeof(mirror)}"
                )
        self.vectorized = bool(self.lib.sl_vectorized())
        self.isa: str = self.lib.sl_isa().decode()  # avx512vnni(+amx), avx2+vnni, avx2 or scalar
        # activation rows up to which the interleaved GEMMs take 8-row tiles (tiles.tune_tiles)
        self.narrow_rows = 1
        self.prefill_threads = 0  # SLUICE_PREFILL_THREADS (0: threads())
        # The worker's thread count, where it leaves torch one thread (TorchBackend.load).
        self.compute_threads = 0

    def threads(self) -> int:
        """The kernels' threads: ``compute_threads`` where set, else torch's."""
        return self.compute_threads or torch.get_num_threads()

    def forward_threads(self, tokens_per_row: int) -> int:
        """Threads for a forward of ``tokens_per_row`` new tokens per sequence: a prompt chunk
        (more than one) may take ``prefill_threads``: a worker that leaves a core to the API for
        decode can still give a prompt every core, since nothing streams while a prompt is read;
        logits do not depend on the thread count (forward.c)."""
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
                _loaded.narrow_rows = tune_tiles(_loaded)
                log.info(
                    "sluice CPU kernels: %s, 8-row GEMM tiles up to %d activation rows",
                    _loaded.isa, _loaded.narrow_rows,
                )  # fmt: skip
            except (OSError, RuntimeError) as exc:
                log.warning("sluice CPU kernels unavailable, using torch's int4 kernels: %s", exc)
        return _loaded
