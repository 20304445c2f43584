"""Host tensors on 2 MB pages: the packed weights and the CPU KV pool, which every step reads.

Owns ``huge_empty`` and ``on_huge_pages``. Linux backs memory with 4 KB pages unless a range is
marked ``MADV_HUGEPAGE`` (transparent huge pages in their default ``madvise`` mode), and torch
marks nothing. A decode step streams ~100 MB of weights and each sequence's keys and values, one
TLB entry per 4 KB: on a Zen 4 EPYC (2 vCPU, default model) the same forward on 2 MB pages was
3-4 % faster (one row after 100 and 900 cached tokens: 3.86 to 3.72 ms, 5.53 to 5.38; four
streams' rows after 900: 8.74 to 8.46 ms), and four streams over a pool whose blocks they took
in turns (as streams decoding together leave them) went from 12.98 to 11.45 ms
(docs/benchmarks.md, *Huge pages*). The values are the same bits: only the pages differ.

Where the kernel has no transparent huge pages (or not Linux), the advice is refused and the
tensor is an ordinary one. Knows nothing about models or caches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys

import torch

__all__ = ["HUGE_PAGE", "huge_empty", "on_huge_pages"]

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_advise = _madvise()
_refused = False  # logged once: the kernel said no


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, starting on a 2 MB boundary and advised
    onto 2 MB pages before anything touches it (a page is then huge from its first fault).
    Tensors under 2 MB are ordinary ones: they would not fill one such page."""
    global _refused
    size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if _advise is None or size < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    # a 2 MB margin to start on a boundary; the margin is never touched, so never backed
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    start = raw.data_ptr() + skip
    if _advise(start, size // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE) != 0 and not _refused:
        _refused = True
        log.info("no transparent huge pages here (madvise: errno %d)", ctypes.get_errno())
    return raw[skip : skip + size].view(dtype).view(shape)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in ``huge_empty``'s memory (``t`` itself when it
    is under 2 MB)."""
    if t.numel() * t.element_size() < HUGE_PAGE:
        return t
    out = huge_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
