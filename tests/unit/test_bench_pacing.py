"""``ops/bench/pacing.py``'s modes without a model: a fixed pacer verifies every offered draft
up to its length, a baseline pacer comes from another checkout's file, and paired ratios set
each round against its own "off" run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ops.bench.pacing import FixedPacer, baseline_pacer, paired, speculator
from services.worker import draft_pacing
from services.worker.draft_pacing import DraftRecord


def test_a_fixed_pacer_verifies_every_offer_up_to_its_length() -> None:
    pacer = FixedPacer(4, 2)
    offers = [(DraftRecord(), 1, 4), (DraftRecord(), 4, 1), (DraftRecord(), 2, 3)]
    assert pacer.allot(offers, rows=64, tokens=64) == [2, 1, 2]  # whatever the step
    assert not pacer.hopeless(DraftRecord(), rows=64, tokens=64)


def test_a_baseline_pacer_is_the_class_in_the_file_given(tmp_path: Path) -> None:
    source = Path(draft_pacing.__file__).read_text()
    path = tmp_path / "draft_pacing.py"
    path.write_text(source.replace("MIN_CHANCE = 0.8", "MIN_CHANCE = 0.5"))
    pacer = baseline_pacer(path, 4)
    assert type(pacer).__module__ == "baseline_draft_pacing" and pacer.MIN_CHANCE == 0.5
    args = argparse.Namespace(k=4, baseline=path)
    spec = speculator("baseline", args)
    assert spec is not None and spec.pacer.MIN_CHANCE == 0.5
    assert speculator("off", args) is None
    fixed = speculator("fixed:3", args)
    assert fixed is not None and isinstance(fixed.pacer, FixedPacer) and fixed.pacer.k == 3
    assert fixed.k == 4  # the speculator's most: --k
    longer = speculator("pacer:8", args)
    assert longer is not None and longer.k == 8 and type(longer.pacer) is draft_pacing.DraftPacer
    with pytest.raises(SystemExit):
        speculator("baseline", argparse.Namespace(k=4, baseline=None))


def test_paired_ratios_set_each_round_against_its_own_off_run() -> None:
    assert paired([110.0, 90.0, 210.0], [100.0, 100.0, 200.0]) == pytest.approx([1.1, 0.9, 1.05])
    with pytest.raises(ValueError, match="shorter"):  # a round without its "off" run: a bug
        paired([1.0, 2.0], [1.0])
