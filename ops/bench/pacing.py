"""Draft pacing A/B: the speculative benchmark's jobs under several pacers, alternating in one
process on one loaded model.

On the 2-core machines this runs on, the same work measures 7-20 % apart minutes later, and
even across one bench run's pairs; a pacer's gain of a few percent is only seen when its runs
alternate with the others' many times over one loaded model. Modes, each with its own
``Speculator`` kept from round to round (as a serving worker keeps one):

* ``off``: no speculator, the reference for every ratio;
* ``pacer``: this checkout's ``DraftPacer``;
* ``pacer:K``: the same, with drafts of up to ``K`` tokens (``--k``: the others' most);
* ``fixed:K``: every offered draft verified up to ``K`` tokens (no cost model);
* ``baseline``: the ``DraftPacer`` of ``--baseline FILE`` (another checkout's
  ``services/worker/draft_pacing.py``, with the same interface; one from before sequences
  stopped resting after rejected drafts, whose speculator asked ``due``, rests none here).

With ``--warm WORKLOAD`` each speculator first runs another workload, untimed: a fresh story
after a code edit starts from the match-length estimates copying taught the pacer, as it does in
the speculative bench, which runs its workloads in that order on one worker.

Rounds alternate the modes' order (forwards, then backwards). Prints, per mode, the median
tokens/s (``ops.bench.speculative.run``'s measure), its ratio to the "off" median, each
round's rate and (draft tokens, accepted) per run, and the median of each round's ratio to its
"off" run (``paired_vs_off``: spared the drift between rounds); every run's output must equal
the first's::

    .venv/bin/python -m ops.bench.pacing --workload code_edit --concurrency 4 --rounds 6 \\
        --modes off pacer fixed:2 baseline --baseline /tmp/old/draft_pacing.py
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from ops.bench.machine_load import emit
from ops.bench.speculative import client_jobs, prompts, run
from services.worker.draft_pacing import DraftPacer, DraftRecord, Offer
from services.worker.speculation import Speculator
from services.worker.torch_backend import TorchBackend
from shared.config import Settings


class FixedPacer(DraftPacer):
    """Verifies every offered draft up to ``k`` tokens: what drafting alone gives, no pacing."""

    def __init__(self, max_n: int, k: int) -> None:
        super().__init__(max_n)
        self.k = k

    def hopeless(self, record: DraftRecord, *, rows: int, tokens: int) -> bool:
        return False

    def allot(self, offers: list[Offer], *, rows: int, tokens: int) -> list[int]:
        return [min(length, self.k) for _, _, length in offers]


def baseline_pacer(path: Path, max_n: int) -> Any:
    """The ``DraftPacer`` defined in the file at ``path``, built for ``max_n``."""
    spec = importlib.util.spec_from_file_location("baseline_draft_pacing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.DraftPacer(max_n)


def speculator(mode: str, args: argparse.Namespace) -> Speculator | None:
    """A fresh speculator for ``mode`` (None for "off")."""
    if mode == "off":
        return None
    name, _, k = mode.partition(":")
    if name == "pacer" and k:  # this checkout's pacer, drafting up to k tokens
        return Speculator(int(k))
    spec = Speculator(args.k)
    if name == "fixed":
        spec.pacer = FixedPacer(spec.max_n, int(k))
    elif mode == "baseline":
        if args.baseline is None:
            raise SystemExit("mode baseline needs --baseline FILE")
        spec.pacer = baseline_pacer(args.baseline, spec.max_n)
    elif mode != "pacer":
        raise SystemExit(f"unknown mode {mode!r}")
    return spec


def paired(rates: list[float], off: list[float]) -> list[float]:
    """Each round's rate over the same round's "off" rate."""
    return [x / o for x, o in zip(rates, off, strict=True)]


async def bench(args: argparse.Namespace) -> None:
    """Run every mode ``args.rounds`` times on the same jobs and print each mode's summary."""
    b = TorchBackend.load(
        Settings(
            threads=args.threads, max_batch=args.concurrency, speculative=True, dtype=args.dtype
        ),
        "smollm2",
        None,
    )
    await b.start()
    try:
        text = prompts()[args.workload]
        jobs, reads = client_jobs(b, text, args.concurrency, 1, args.tokens)
        specs = {mode: speculator(mode, args) for mode in args.modes}
        if args.warm:  # each speculator first learns from another workload, as a server's has
            warm, _ = client_jobs(b, prompts()[args.warm], args.concurrency, 1, args.tokens)
            for learner in specs.values():
                if learner is not None:  # "off" has nothing to learn
                    b.scheduler.speculator = learner
                    await run(b, warm)
        await run(b, reads)  # after the warm-up, whose prompts could evict these
        rates: dict[str, list[float]] = {mode: [] for mode in args.modes}
        drafted: dict[str, list[tuple[int, int]]] = {mode: [] for mode in args.modes}
        first: list[list[int]] | None = None
        for r in range(args.rounds):
            for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
                spec = specs[mode]
                b.scheduler.speculator = spec
                was = (spec.stats.draft_tokens, spec.stats.accepted_tokens) if spec else (0, 0)
                rate, ids = await run(b, jobs)
                first = first or ids
                if ids != first:
                    raise SystemExit(f"{mode}: output differs from the first run's")
                now = (spec.stats.draft_tokens, spec.stats.accepted_tokens) if spec else (0, 0)
                rates[mode].append(rate)
                drafted[mode].append((now[0] - was[0], now[1] - was[1]))
        off = statistics.median(rates["off"]) if "off" in rates else None
        for mode in args.modes:
            median = statistics.median(rates[mode])
            emit(
                {
                    "workload": args.workload,
                    "concurrency": args.concurrency,
                    "mode": mode,
                    "median_tok_s": round(median, 1),
                    "vs_off": round(median / off, 3) if off else None,
                    # rounds ran the modes back to back: the median of each round's ratio is
                    # spared the drift between rounds that the ratio of medians is not
                    "paired_vs_off": round(statistics.median(paired(rates[mode], rates["off"])), 3)
                    if off
                    else None,
                    "runs": [round(x, 1) for x in rates[mode]],
                    "drafted_accepted": drafted[mode],
                }
            )
    finally:
        await b.stop()


def main() -> None:
    """Parse arguments and run the A/B."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="code_edit", choices=sorted(prompts()))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step, at most")
    parser.add_argument("--modes", nargs="+", default=["off", "pacer", "fixed:2"])
    parser.add_argument("--baseline", type=Path, help="a draft_pacing.py for mode baseline")
    parser.add_argument("--dtype", default="auto", help="SLUICE_DTYPE (float32: torch's model)")
    parser.add_argument(
        "--warm", choices=sorted(prompts()), help="a workload each pacer runs first, untimed"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
