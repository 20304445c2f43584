"""A random-weight model of a real shape as a Hugging Face directory that ``sluice worker``
serves (``services/worker/loaders/hf.py``), with a word-level tokenizer of exactly the shape's
vocabulary (every id decodes to one word, so random weights still stream text) and a ChatML
template; and prompts of its words. Used by ``gpu_stack.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jinja2
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

__all__ = ["NAME", "prompts", "write_model"]

NAME = "bench"  # the served model id
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROLES = ["user", "assistant", "system"]  # the template's words, ids after the specials
FIRST_WORD = len(SPECIAL) + len(ROLES)  # prompts draw from the plain words only
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_model(directory: Path, shape: str, device: str) -> None:
    """A random bf16 model of ``shape`` in the Hugging Face layout ``load_hf_dir`` reads."""
    import torch
    from safetensors.torch import save_file

    from ops.bench.gpu_engine import SHAPES, build
    from tests.worker_models import hf_state_dict

    directory.mkdir(parents=True)
    cfg = SHAPES[shape]
    state = hf_state_dict(build(shape, torch.device(device), torch.bfloat16))
    save_file({k: v.cpu() for k, v in state.items()}, str(directory / "model.safetensors"))
    config = {**cfg, "torch_dtype": "bfloat16", "eos_token_id": SPECIAL.index("<|im_end|>")}
    (directory / "config.json").write_text(json.dumps(config))
    words = [*SPECIAL, *ROLES] + [f"w{i}" for i in range(FIRST_WORD, int(cfg["vocab_size"]))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: ids decode space-joined
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(directory / "tokenizer.json"))
    tok_cfg = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False}))


def prompts(model: Path, count: int, tokens: int, seed: int) -> list[str]:
    """``count`` prompts of random words, each ``tokens`` tokens once the template wraps it."""
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    wrap = jinja2.Template(CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": ""}], add_generation_prompt=True
    )
    n = max(1, tokens - len(tok.encode(wrap).ids))
    rng, vocab = random.Random(seed), tok.get_vocab_size()
    return [
        " ".join(f"w{rng.randrange(FIRST_WORD, vocab)}" for _ in range(n)) for _ in range(count)
    ]
