"""``ops/bench/speculative.py``'s check that a workload's answer is the copy it asks for."""

from __future__ import annotations

from ops.bench.speculative import from_prompt
from shared.jobs import GenerateRequest, Job


def job(ids: list[int]) -> Job:
    return Job.of(GenerateRequest(request_id="r", model="m"), prompt_token_ids=ids, prompt_text="")


def test_a_copy_scores_one_and_fresh_text_zero() -> None:
    prompt = list(range(100, 140))
    assert from_prompt([[job(prompt)]], [prompt[5:30]]) == 1.0
    assert from_prompt([[job(prompt)]], [list(range(1, 30))]) == 0.0


def test_each_answer_is_matched_against_its_own_prompt() -> None:
    a, b = list(range(100, 120)), list(range(200, 220))
    # the second client's answer copies the first client's prompt: not its own
    assert from_prompt([[job(a)], [job(b)]], [a[:10], a[:10]]) == 0.5
    # a repetition of one sentence of the prompt's words, out of order: few of its 4-grams
    assert from_prompt([[job(a)]], [[a[0], a[5], a[1], a[7]] * 5]) == 0.0
