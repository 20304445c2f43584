"""Constrained decoding on CUDA: masks applied on the device equal the CPU path; a tiny model in
bf16 on the GPU writes schema-valid JSON. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from services.worker.constrain import Constrainer, ConstraintState
from services.worker.loaders import load_model
from services.worker.torch_backend import TorchBackend
from shared.events import AnyEvent, TextDelta
from shared.grammar import constraint_grammar
from shared.jobs import Constraint, GenerateRequest, Message, SamplingParams, TextPart
from tests.invariants import check_stream
from tests.job_factory import as_job
from tests.worker_models import tiny_tokenizer, write_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer", "maximum": 99}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


def test_cuda_masks_equal_cpu_masks() -> None:
    tk = tiny_tokenizer()
    vocab = tk.get_vocab_size()
    c = Constrainer(tk.to_str(), vocab=vocab, eos_ids=[2], max_batch=4)
    grammar = constraint_grammar(Constraint(kind="json_schema", json_schema=SCHEMA))

    def fresh() -> ConstraintState:
        return ConstraintState(
            matcher=c._matcher(grammar), reasoning=None, inside=False, may_open=False
        )

    logits = torch.randn(3, vocab)
    on_cpu = c.apply(logits.clone(), c.begin([fresh(), None, fresh()]))  # type: ignore[arg-type]
    on_gpu = c.apply(logits.cuda(), c.begin([fresh(), None, fresh()]))  # type: ignore[arg-type]
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), on_cpu)


async def test_tiny_model_on_cuda_writes_valid_json(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "tiny", "Qwen3ForCausalLM", seed=3, max_position_embeddings=1024)
    backend = TorchBackend(load_model(str(tmp_path / "tiny"), device="cuda"), max_batch=4)
    await backend.start()
    try:
        for seed in range(3):
            request = GenerateRequest(
                request_id=f"r{seed}",
                model="tiny",
                messages=[Message(role="user", content=[TextPart(text="A city?")])],
                sampling=SamplingParams(temperature=1.0, seed=seed),
                chat_template_kwargs={"enable_thinking": False},
                max_tokens=60,
                constraint=Constraint(kind="json_schema", json_schema=SCHEMA),
            )
            events: list[AnyEvent] = []
            async for batch in backend.generate(as_job(request, backend), [], 1):
                events.extend(batch)
            check_stream(events)
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            jsonschema.validate(json.loads(text), SCHEMA)
    finally:
        await backend.stop()
