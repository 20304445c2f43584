"""The skinny linears (a decode step's few rows, the norm or gate fused in) against the torch
ops they replace, through Triton's interpreter on CPU tensors (compiled where a GPU is
present); and where each site's choice sends it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker import fused_ops, skinny
from services.worker.models.llama import RMSNorm
from tests.unit.worker.test_paged_attention import DEV

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels on (interpreted on CPU), each test with its own measured choices."""
    monkeypatch.setattr(fused_ops, "FORCE", True)
    monkeypatch.setattr(skinny, "CHOICES", {})


def layer(k: int, n: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(DEV)


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEV)


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[1], eps)
    with torch.no_grad():
        norm.weight.copy_(weight.cpu())
    was = fused_ops.FORCE
    fused_ops.FORCE = False  # torch's module on CPU
    try:
        out: torch.Tensor = norm(x.cpu())
        return out
    finally:
        fused_ops.FORCE = was


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-4, rtol=1e-4)


# K not a multiple of any candidate's BK and N not one of BN: the masked edges are read
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_torch(m: int, bias: bool) -> None:
    lin, x = layer(300, 50, bias, 1), rows(m, 300, 2)
    with torch.no_grad():
        close(skinny.linear(x, lin), F.linear(x.cpu(), lin.weight.cpu(), _cpu(lin.bias)))


@pytest.mark.parametrize("m", [1, 5])
def test_add_norm_linear_equals_the_separate_ops(m: int) -> None:
    lin, x, delta = layer(200, 70, True, 3), rows(m, 200, 4), rows(m, 200, 5)
    weight = (1 + 0.1 * rows(1, 200, 6))[0]
    with torch.no_grad():
        total, y = skinny.norm_linear(x, delta, weight, 1e-5, lin)
        want_total = x.cpu() + delta.cpu()
        want = F.linear(reference_norm(want_total, weight, 1e-5), lin.weight.cpu(), _cpu(lin.bias))
    close(total, want_total)
    close(y, want)


def test_norm_linear_without_a_delta_normalises_the_stream_itself() -> None:
    lin, x = layer(130, 40, False, 7), rows(2, 130, 8)
    weight = (1 + 0.1 * rows(1, 130, 9))[0]
    with torch.no_grad():
        total, y = skinny.norm_linear(x, None, weight, 1e-6, lin)
        want = F.linear(reference_norm(x, weight, 1e-6), lin.weight.cpu())
    assert total is x
    close(y, want)


def test_swiglu_linear_equals_silu_gate_times_up() -> None:
    lin, both = layer(300, 33, False, 10), rows(4, 600, 11)
    gate, up = both.cpu().chunk(2, dim=-1)
    with torch.no_grad():
        close(skinny.swiglu_linear(both, lin), F.linear(F.silu(gate) * up, lin.weight.cpu()))


@pytest.mark.parametrize("shape", skinny.CANDIDATES)
def test_every_candidate_shape_computes_the_same(shape: skinny.Shape) -> None:
    """The measured choice may pick any candidate: each must be right."""
    lin, x, delta = layer(260, 90, True, 12), rows(3, 260, 13), rows(3, 260, 14)
    weight = (1 + 0.1 * rows(1, 260, 15))[0]
    with torch.no_grad():
        _, y = skinny._launch(shape, skinny.ADD_NORM, x, lin, delta, weight, 1e-5)
        want = F.linear(
            reference_norm(x.cpu() + delta.cpu(), weight, 1e-5), lin.weight.cpu(), _cpu(lin.bias)
        )
    close(y, want)


def test_sites_the_measurement_gave_to_torch_and_large_batches_skip_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("the skinny kernel ran")

    lin, few, many = layer(64, 32, False, 16), rows(2, 64, 17), rows(skinny.MAX_ROWS + 1, 64, 18)
    with torch.no_grad():
        skinny.linear(few, lin)
        key = skinny._key(skinny.PLAIN, few, lin)
        assert skinny.CHOICES[key] == skinny.CANDIDATES[0]  # the interpreter's choice
        skinny.CHOICES[key] = None  # as when torch's op measured faster
        monkeypatch.setattr(skinny, "_launch", no_kernel)
        close(skinny.linear(few, lin), F.linear(few.cpu(), lin.weight.cpu()))
        close(skinny.linear(many, lin), F.linear(many.cpu(), lin.weight.cpu()))
        monkeypatch.setattr(skinny, "ENABLED", False)
        one = rows(1, 64, 19)
        close(skinny.linear(one, lin), F.linear(one.cpu(), lin.weight.cpu()))


def test_rows_share_a_choice_per_power_of_two() -> None:
    lin = layer(64, 32, False, 20)
    keys = {skinny._key(skinny.PLAIN, rows(m, 64, 0), lin)[-1] for m in (1, 2, 3, 4, 5, 9, 16)}
    assert keys == {1, 2, 4, 8, 16}


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()
