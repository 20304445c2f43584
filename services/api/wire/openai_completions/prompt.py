"""A legacy completion's prompt as token ids: raw text, token ids, or fill-in-the-middle.

No chat template: the client writes the whole prompt, as it would for a base model. So, as vLLM
and llama.cpp do, added tokens it spells (``<|im_start|>``, ``<fim_prefix>``) are matched: a
raw prompt is how a client writes its own template. The card's BOS is prepended where the
tokenizer expects one and the text does not begin with it.

With ``suffix`` the prompt is fill-in-the-middle in the prefix-suffix-middle order every FIM
model was trained on: ``<prefix-token> prefix <suffix-token> suffix <middle-token>``. The three
tokens are looked up by name in the tokenizer's vocabulary (``FIM_SPELLINGS``: StarCoder and
SmolLM2, Qwen2.5-Coder and CodeGemma, DeepSeek-Coder), never per model; a tokenizer with none
of them is a 400. Prefix and suffix are code the client quotes, so they are encoded as plain
text: a file that happens to contain ``<fim_suffix>`` cannot move the hole.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from shared.errors import InvalidRequest
from shared.prompt import PromptRenderer, RenderedPrompt

__all__ = [
    "FIM_SPELLINGS",
    "build_prompt",
    "echo_ids",
    "fim_tokens",
    "raw_ids",
    "token_strings",
]

# (prefix, suffix, middle) token names, in the order they are tried.
FIM_SPELLINGS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM2, Granite code
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_tokens(tokenizer: Tokenizer) -> tuple[tuple[str, int], ...] | None:
    """The tokenizer's FIM tokens as ``(text, id)`` for prefix, suffix and middle, or None.

    Args:
        tokenizer: the model's tokenizer.

    Returns:
        The first spelling of ``FIM_SPELLINGS`` whose three tokens are all in the vocabulary.
    """
    for names in FIM_SPELLINGS:
        ids = [tokenizer.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            return tuple((name, int(i)) for name, i in zip(names, ids, strict=True))  # type: ignore[arg-type]
    return None


def raw_ids(renderer: PromptRenderer, text: str, *, bos: bool = True) -> list[int]:
    """Token ids of raw prompt text: added tokens it spells matched, BOS where the card wants.

    Args:
        renderer: the model's renderer (its tokenizer and card).
        text: the prompt text.
        bos: prepend the card's BOS when the tokenizer expects one and the text lacks it.

    Returns:
        The ids.
    """
    ids = list(renderer.tokenizer.encode(text, add_special_tokens=False).ids)
    return _with_bos(renderer, text, ids) if bos else ids


def _with_bos(renderer: PromptRenderer, text: str, ids: list[int]) -> list[int]:
    card = renderer.card
    if not (card.add_bos_token and card.bos_token) or text.startswith(card.bos_token):
        return ids
    bos = renderer.tokenizer.token_to_id(card.bos_token)
    return ids if bos is None else [bos, *ids]


def build_prompt(
    renderer: PromptRenderer, prompt: str | list[int], suffix: str | None
) -> RenderedPrompt:
    """Tokenize a completion's prompt (and suffix) for the model.

    Args:
        renderer: the model's renderer (its tokenizer and card).
        prompt: raw text, or token ids the client tokenized itself (kept as they are).
        suffix: the text after the hole, for fill-in-the-middle; None for a plain completion.

    Returns:
        The prompt's text and ids; a completion never starts inside a reasoning block that
        anyone routes (the job is ``raw_text``).

    Raises:
        InvalidRequest: an empty prompt, ids outside the vocabulary, a suffix with token ids,
            or a suffix for a model whose tokenizer has no FIM tokens.
    """
    tokenizer = renderer.tokenizer
    if isinstance(prompt, list):
        if suffix is not None:
            raise InvalidRequest("suffix needs the prompt as text, not token ids", param="suffix")
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if any(not 0 <= i < vocab for i in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        return RenderedPrompt(text=text, token_ids=list(prompt), starts_in_reasoning=False)
    if suffix is None:
        ids = raw_ids(renderer, prompt)
        if not ids:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return RenderedPrompt(text=prompt, token_ids=ids, starts_in_reasoning=False)
    fim = fim_tokens(tokenizer)
    if fim is None:
        raise InvalidRequest(
            f"model '{renderer.card.name}' has no fill-in-the-middle tokens, so suffix is not "
            "supported for it",
            param="suffix",
        )
    (pre, pre_id), (suf, suf_id), (mid, mid_id) = fim
    ids = [
        pre_id,
        *renderer.text_ids(prompt),
        suf_id,
        *renderer.text_ids(suffix),
        mid_id,
    ]
    text = f"{pre}{prompt}{suf}{suffix}{mid}"
    return RenderedPrompt(
        text=text, token_ids=_with_bos(renderer, text, ids), starts_in_reasoning=False
    )


def token_strings(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (``echo`` with ``logprobs`` lists the prompt's tokens).

    Args:
        tokenizer: the model's tokenizer.
        ids: token ids.

    Returns:
        One string per id, decoded alone (a byte that is part of a longer character decodes to
        U+FFFD, as with any server that lists tokens one by one).
    """
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def echo_ids(renderer: PromptRenderer, prompt: str | list[int]) -> list[int]:
    """The ids of the prompt as echoed: the client's own, without a BOS sluice prepended.

    Args:
        renderer: the model's renderer.
        prompt: the prompt as the client sent it.

    Returns:
        Token ids whose texts concatenate to the echoed prompt.
    """
    if isinstance(prompt, list):
        return list(prompt)
    return raw_ids(renderer, prompt, bos=False)
