"""The prefill GEMMs alone, AMX tiles against the AVX-512 VNNI tiles, per weight layout.

Builds the native kernels (``avx512vnni+amx`` on a CPU with AMX int8) and the same sources with
``-DSL_NO_AMX``, packs random GGUF blocks of each type (Q4_1 and Q4_0: the 4-bit layout; Q8_0;
Q5_1: ``SL_Q8_M``; Q6_K: ``SL_Q8_16``) at the default model's shapes (fused QKV 960 x 576,
gate|up 3072 x 576, down 576 x 1536; K 512 for Q6_K, whose blocks hold 256 values), and times
``--rows`` activation rows through each build, alternating, on one thread (CPU time of this
thread: a busy neighbour disturbs it less). Prints the best of ``--repeats`` per build as JSON,
with GFLOP/s, and checks that both builds' outputs are the same bits.

    .venv/bin/python -m ops.bench.amx_gemm --rows 190
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from services.worker import kernels
from services.worker.kernels import FLAGS, Activations, Kernels, build
from services.worker.models.blocks import BLOCK_BYTES, HALVES, QuantBlocks
from services.worker.models.kernel_llama import PackedLinear

QK = 32
TYPES = {"Q4_1": 3, "Q4_0": 2, "Q8_0": 8, "Q5_1": 7, "Q6_K": 14}
SHAPES = [(960, 576), (3072, 576), (576, 1536)]


def random_blocks(qtype: int, n: int, k: int, g: torch.Generator) -> QuantBlocks:
    """Random bytes (every pattern is a valid block) with small finite f16 scales."""
    per = 256 if qtype == 14 else QK
    raw = torch.randint(0, 256, (n, k // per, BLOCK_BYTES[qtype]), generator=g).to(torch.uint8)
    for at in HALVES[qtype]:
        half = (torch.rand(n, k // per, 1, generator=g) * 0.004 + 0.0005).half()
        raw[..., at : at + 2] = half.view(torch.uint8)
    return QuantBlocks(qtype, raw.view(n, -1), (n, k))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=190)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    amx = kernels.load()
    assert amx is not None and amx.isa.endswith("+amx"), "no AMX build here"
    vnni = Kernels(build(flags=[*FLAGS, "-DSL_NO_AMX"], directory=Path(tempfile.mkdtemp())))
    g = torch.Generator().manual_seed(0)
    print(json.dumps({"load1": os.getloadavg()[0], "rows": args.rows, "isa": amx.isa}))
    for name, qtype in TYPES.items():
        for n, k in SHAPES:
            k = 512 if qtype == 14 and k % 256 else k
            linear = PackedLinear(random_blocks(qtype, n, k, g), None)
            a = Activations(args.rows, k)
            a.q.copy_(torch.randint(-127, 128, (args.rows, k), generator=g).to(torch.int8))
            a.d.copy_(torch.rand(args.rows, k // QK, generator=g) * 0.05 + 0.001)
            a.s.copy_(a.d * a.q.float().view(args.rows, -1, QK).sum(-1))
            best = {"vnni": float("inf"), "amx": float("inf")}
            out = {}
            for _ in range(args.repeats):
                for key, built in (("vnni", vnni), ("amx", amx)):
                    y = torch.empty(args.rows, n)
                    began = time.thread_time()
                    linear(built, a, y)
                    best[key] = min(best[key], time.thread_time() - began)
                    out[key] = y
            flop = 2 * args.rows * n * k
            row = {"type": name, "n": n, "k": k, "same_bits": torch.equal(out["vnni"], out["amx"])}
            row |= {f"{key}_ms": round(s * 1e3, 3) for key, s in best.items()}
            row |= {f"{key}_gflop_s": round(flop / s / 1e9, 1) for key, s in best.items()}
            row["amx_vs_vnni"] = round(best["vnni"] / best["amx"], 2)
            print(json.dumps(row))
    print(json.dumps({"load1_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
