"""Our forward against an independent implementation: transformers, on the same tiny weights.

Skipped where transformers is not installed (it is not a project dependency); the GPU machine's
image has it, and ``docs/benchmarks.md`` records that run.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from services.worker.loaders import load_model
from tests.model_runs import Slots, model_cache, prefill_logits
from tests.worker_models import ARCH_MODEL_TYPE, write_hf_model

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)


@pytest.mark.parametrize("arch", sorted(ARCH_MODEL_TYPE))
def test_logits_and_greedy_match_transformers(tmp_path: Path, arch: str) -> None:
    write_hf_model(tmp_path / "m", arch, seed=21)
    ours = load_model(str(tmp_path / "m"), device="cpu", dtype="float32")
    with warnings.catch_warnings():  # the reference's own advisory warnings are not ours
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "m"), dtype=torch.float32
        ).eval()
    ids = ours.tokenizer.encode("The capital of France is Paris. Hello world!").ids
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = prefill_logits(ours.model, ids)
        want = ref(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        generated = ref.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids)),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    seq = list(ids)
    slots = Slots(model_cache(ours.model), 1)
    mine: list[int] = []
    with torch.inference_mode():
        logits = slots.forward(ours.model, torch.tensor([seq]), [0], [0])
        for _ in range(12):
            token = int(logits[0, -1].argmax())
            mine.append(token)
            logits = slots.forward(ours.model, torch.tensor([[token]]), [0], [len(seq)])
            seq.append(token)
    assert mine == generated
