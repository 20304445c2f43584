#!/usr/bin/env bash
# ops/bench/gpu_suite.sh [OUT_DIR]: the GPU checks in one go, for a GPU host (python3 there has
# torch with CUDA and triton; sluice's own dependencies installed or on PYTHONPATH).
#   1. the tests that need or use CUDA: tests/gpu, and the unit tests of the paged attention
#      kernel, the decode graphs and the batched sampler (run on the device there);
#   2. ops.bench.gpu_engine (every shape and batch size; BENCH_ARGS to narrow it).
# Logs and the benchmark's JSON lines go to OUT_DIR (default gpu-results). Each part has its own
# time limit (TEST_TIMEOUT, BENCH_TIMEOUT seconds) so one that hangs leaves the other its time.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/machine.txt"
# ini warnings-as-errors off: the host's libraries may warn where the dev venv's do not
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -o filterwarnings=default \
    tests/gpu tests/unit/worker/test_paged_attention.py tests/unit/worker/test_cuda_graphs.py \
    tests/unit/worker/test_batch_sampling.py tests/unit/worker/test_batch_sampling_engine.py \
    tests/unit/worker/test_fused_ops.py 2>&1 | tee "$out/tests.log"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout "${BENCH_TIMEOUT:-300}" python3 -m ops.bench.gpu_engine --out "$out/bench.jsonl" \
    ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
