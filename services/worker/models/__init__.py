"""The architecture registry: Hugging Face ``architectures``/``model_type`` and GGUF
``general.architecture`` names mapped to model classes. Add an architecture by adding a file and
a line here; there is no factory with one branch per model.
"""

from __future__ import annotations

from services.worker.models.llama import LlamaModel
from services.worker.models.mistral import MistralModel
from services.worker.models.qwen2 import Qwen2Model
from services.worker.models.qwen3 import Qwen3Model

__all__ = ["MODELS", "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"]

MODELS: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "llama": LlamaModel,
    "MistralForCausalLM": MistralModel,
    "mistral": MistralModel,
    "Qwen2ForCausalLM": Qwen2Model,
    "qwen2": Qwen2Model,
    "Qwen3ForCausalLM": Qwen3Model,
    "qwen3": Qwen3Model,
}
