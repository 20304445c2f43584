"""How many activation rows the interleaved GEMMs take with 8 weight rows per tile before 16.

On AVX-512 the 4- and 8-bit GEMMs can serve sixteen weight rows per 512-bit instruction, half the
row-dependent instructions of two 8-row tiles, at the price of reading two groups' weights at
once. Which wins depends on the CPU and on how many activation rows share a weight pass. On a
Zen 4 EPYC (a 512-bit instruction runs as two 256-bit halves), with the weights read from
memory as a forward reads them, the 8-row tile ran a 3072 x 576 GEMM 1.2-1.5x as fast for 2 to
9 rows (40 us against 58 for two rows) and the 16-row one won from 16 rows on (426 us against
534 for 64); SmolLM2's whole forward after 1,000 cached tokens took 5.5 ms against 6.8 for two
rows and 7.9 against 9.2 for five. On a Cascade Lake Xeon the 16-row tile ran four to eight
rows' steps 1.14-1.33x as fast. So the crossover is measured when the kernels load and set with
``sl_set_narrow_rows``. Both tiles give the same bits: only speed depends on the measurement.

The weights are cycled through a buffer several times the last-level cache: from a cache-resident
matrix the 16-row tile won at every row count on that EPYC too (17 us against 22 for two rows).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.kernels import Kernels

__all__ = ["tune_tiles"]

N, K = 3072, 576  # SmolLM2-135M's gate/up projection
MATRIX = N * K // 2  # its 4-bit weights' bytes
MOST = 16  # rows measured, at most: past two tiles of eight the 16-row one amortizes its reads
CALLS, SAMPLES = 8, 5  # GEMMs per timed sample, samples per tile and row count
L3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")


def _weight_bytes() -> int:
    """Four times the last-level cache (64 MiB where it cannot be read), at most 256 MiB."""
    try:
        text = L3.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        cache = int(text.rstrip("KM")) * scale
    except (OSError, ValueError, IndexError):
        cache = 16 << 20
    return min(max(4 * cache, 64 << 20), 256 << 20)


def tune_tiles(k: Kernels) -> int:
    """Measure and set the most activation rows the 8-row tile takes (1: from two rows on, the
    16-row one); builds without AVX-512 have only the 8-row tile. Returns the setting."""
    if not k.isa.startswith("avx512"):
        return 1
    copies = _weight_bytes() // MATRIX
    weights = torch.empty(copies * MATRIX, dtype=torch.uint8).fill_(0x5A)  # values: any
    scales = torch.full((N * K // 32,), 0.01)
    mins = -8 * scales
    xq = torch.ones(MOST, K, dtype=torch.int8)
    xd, xs = torch.full((MOST, K // 32), 0.01), torch.zeros(MOST, K // 32)
    y = torch.empty(MOST, N)
    at = 0

    def sample(m: int, narrow: int) -> float:
        nonlocal at
        k.lib.sl_set_narrow_rows(narrow)
        began = time.perf_counter()
        for _ in range(CALLS):
            at = (at + 1) % copies  # a matrix not in cache, as a forward's next layer
            k.lib.sl_gemm_q4_1(
                m, N, K, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(),
                weights.data_ptr() + at * MATRIX, scales.data_ptr(), mins.data_ptr(), 0,
                y.data_ptr(), 0, k.threads(),
            )  # fmt: skip
        return time.perf_counter() - began

    sample(1, 1)  # the first call's one-time costs (fill_ has already touched every page)
    rows = 1
    for m in range(2, MOST + 1):
        # alternating, so that a slow spell of the machine falls on both
        narrow, wide = [], []
        for _ in range(SAMPLES):
            narrow.append(sample(m, m))
            wide.append(sample(m, m - 1))
        if statistics.median(narrow) >= statistics.median(wide):
            break
        rows = m
    k.lib.sl_set_narrow_rows(rows)
    return rows
