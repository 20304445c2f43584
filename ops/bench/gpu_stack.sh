#!/usr/bin/env bash
# ops/bench/gpu_stack.sh [OUT_DIR]: ops.bench.gpu_stack (the whole stack against the engine alone)
# on a GPU host whose python3 has torch with CUDA but not sluice's own dependencies and reaches
# no package registry. What it lacks comes in .whl/ (git-ignored, carried along): the wheels are
# installed into /tmp/site, and .whl/redis-server (any Redis from 6.2 on; 8.2 was carried) is
# used unless a REDIS_SERVER is given.
# The JSON lines go to OUT_DIR/stack.jsonl, the run's output to OUT_DIR/stack.log, the processes'
# logs (tail-truncated) to OUT_DIR/stacklogs. STACK_TIMEOUT (seconds, default 240) bounds the run;
# STACK_ARGS adds arguments (e.g. "--api-workers 2").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    # --target: no environment to own; console scripts land in /tmp/site/bin, unused (the
    # harness starts every process as python3 -m). Without pip, a wheel is a zip to unpack.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl ||
        python3 -c 'import glob, zipfile
for w in glob.glob(".whl/*.whl"): zipfile.ZipFile(w).extractall("/tmp/site")'
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -f .whl/redis-server && -z "${REDIS_SERVER:-}" ]]; then
    chmod +x .whl/redis-server
    export REDIS_SERVER="$PWD/.whl/redis-server"
fi
# shellcheck disable=SC2086  # STACK_ARGS is a list of arguments
timeout "${STACK_TIMEOUT:-240}" python3 -m ops.bench.gpu_stack --out "$out/stack.jsonl" \
    --logs "$out/stacklogs" ${STACK_ARGS:-} 2>&1 | tee "$out/stack.log"
