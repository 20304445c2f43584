"""Prompt-lookup drafting cost: ``NgramIndex`` on the default model's tokens, no model run.

A sequence's prompt is source text (this repository's worker modules, distinct n-grams as in a
real context) ending with a file of ~2,500 characters, the code-edit workload of
``speculative.py``; its "output" then copies the file back one token a step, and each step asks
the index for a ``--k``-token draft, as the speculator does. Prints one JSON object per prompt
length: the first draft's time (it takes in the whole prompt), the later drafts' median and p99,
the index's memory after the prompt (tracemalloc, in a separate pass: tracing slows the index) and
how many drafts equal what the copy goes on with:

    .venv/bin/python -m ops.bench.drafting --prompt 700 8000
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from pathlib import Path

from ops.bench.machine_load import emit
from services.worker.drafting import NgramIndex
from services.worker.loaders import load_model

WORKER = Path(__file__).resolve().parents[2] / "services" / "worker"


def measure(filler: list[int], file: list[int], prompt_tokens: int, k: int) -> dict[str, object]:
    """Draft once per token of ``file`` after a ``prompt_tokens`` prompt ending with it."""
    prompt = filler[: max(0, prompt_tokens - len(file))] + file
    tracemalloc.start()
    index = NgramIndex()
    index.propose(list(prompt), k)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tokens, index = list(prompt), NgramIndex()
    times, hits = [], 0
    for i in range(len(file)):
        began = time.perf_counter()
        draft = index.propose(tokens, k)
        times.append(time.perf_counter() - began)
        hits += draft == (file + file)[i : i + k]
        tokens.append(file[i])
    later = sorted(times[1:])
    return {
        "prompt_tokens": len(prompt),
        "first_draft_ms": round(times[0] * 1e3, 3),
        "draft_us_p50": round(statistics.median(later) * 1e6, 1),
        "draft_us_p99": round(later[int(0.99 * (len(later) - 1))] * 1e6, 1),
        "index_kib": round(memory / 1024, 1),
        "drafts_right": f"{hits}/{len(file)}",
    }


def main() -> None:
    """Parse arguments and measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt", type=int, nargs="+", default=[700, 8000])
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    tokenizer = load_model(args.model).tokenizer

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    file = ids((WORKER / "sequence.py").read_text()[:2500])
    filler = ids("".join(p.read_text() for p in sorted(WORKER.glob("*.py"))))
    for n in args.prompt:
        emit(measure(filler, file, n, args.k))


if __name__ == "__main__":
    main()
