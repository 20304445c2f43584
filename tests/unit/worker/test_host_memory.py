"""``host_memory``: tensors that start on a 2 MB boundary, advised onto huge pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.worker.host_memory import HUGE_PAGE, huge_empty, on_huge_pages
from services.worker.kv_cache import PagedKVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s first byte carries MADV_HUGEPAGE ("hg")."""
    at, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's address range opens its block
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= at < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def test_a_small_tensor_is_an_ordinary_one() -> None:
    t = huge_empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32
    small = torch.arange(10)
    assert on_huge_pages(small) is small


def test_a_large_tensor_starts_on_a_huge_page_and_holds_its_values() -> None:
    t = huge_empty((3, HUGE_PAGE // 4 + 7), torch.float16)
    assert t.shape == (3, HUGE_PAGE // 4 + 7) and t.dtype == torch.float16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    src = torch.randn(HUGE_PAGE // 2 + 3)
    copy = on_huge_pages(src)
    assert copy.data_ptr() % HUGE_PAGE == 0 and torch.equal(copy, src)
    copy[0] = 1e6  # its own memory
    assert src[0] != 1e6


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages on this kernel",
)
def test_the_kernel_is_told_to_back_it_with_huge_pages() -> None:
    assert advised(huge_empty((HUGE_PAGE,), torch.uint8))
    assert not advised(torch.empty(8 * HUGE_PAGE, dtype=torch.uint8))  # what torch gives


def test_the_cpu_kv_pool_lies_on_huge_pages() -> None:
    cache = PagedKVCache(
        layers=2, num_blocks=1024, block_size=16, kv_heads=2, head_dim=64,
        dtype=torch.float16, device=torch.device("cpu"),
    )  # fmt: skip
    assert cache.k.data_ptr() % HUGE_PAGE == 0 and cache.v.data_ptr() % HUGE_PAGE == 0
    assert cache.k.shape == (2, 2, 1024, 16, 64)
