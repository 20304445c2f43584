"""Legacy completions' prompt on the default model's real tokenizer (read from the GGUF).

SmolLM2-135M-Instruct's tokenizer has no FIM tokens (its added tokens are ChatML's and the
StarCoder metadata tokens, ``<|endoftext|>`` to ``<empty_output>``), so ``suffix`` is its 400;
a raw prompt is its plain tokenization, ChatML control tokens matched. ``slow``, as the other
tests that parse the GGUF.
"""

from __future__ import annotations

import pytest

from services.api.wire.openai_completions import build_prompt
from services.api.wire.openai_completions.prompt import fim_tokens
from shared.errors import InvalidRequest
from tests.unit.shared.test_prompt_smollm2 import smollm2

pytestmark = pytest.mark.slow


def test_default_model_has_no_fim_tokens_so_suffix_is_a_400() -> None:
    renderer = smollm2()
    assert fim_tokens(renderer.tokenizer) is None
    with pytest.raises(InvalidRequest) as info:
        build_prompt(renderer, "def add(a, b):\n", "\nprint(add(1, 2))")
    assert info.value.param == "suffix"


def test_raw_prompt_is_its_plain_tokenization() -> None:
    renderer = smollm2()
    built = build_prompt(renderer, "<|im_start|>user\nThe capital of France is", None)
    assert built.token_ids[0] == 1  # <|im_start|>, matched as the control token
    assert renderer.tokenizer.decode(built.token_ids, skip_special_tokens=False) == built.text
