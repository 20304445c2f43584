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


def test_the_rate_counts_only_tokens_after_every_stream_has_begun(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A stream that decodes while another's prompt is still read must not inflate the rate:
    only what arrives after the last stream's first token counts, over the span after it."""
    import asyncio
    from types import SimpleNamespace

    from ops.bench import speculative

    now = [0.0]
    fifth = asyncio.Event()  # the early stream has sent five tokens
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: now[0])

    class Backend:
        async def generate(self, j: Job, _resume: list[int], _attempt: int):  # type: ignore[no-untyped-def]
            if j.request_id == "late":  # its first token comes once the other has five
                await fifth.wait()
            for k in range(5, 10) if j.request_id == "late" else range(10):
                now[0] = k + (0.5 if j.request_id == "late" else 0.0)
                yield [SimpleNamespace(token_ids=(k,))]
                if k == 4:
                    fifth.set()
                await asyncio.sleep(0)

    def named(rid: str) -> Job:
        return Job.of(
            GenerateRequest(request_id=rid, model="m"), prompt_token_ids=[1], prompt_text=""
        )

    rate, ids = asyncio.run(speculative.run(Backend(), [[named("early")], [named("late")]]))  # type: ignore[arg-type]
    assert ids == [list(range(10)), list(range(5, 10))]
    # after 5.5 (the late stream's first): 6, 7, 8, 9 and 6.5 .. 9.5, over 5.5 .. 9.5
    assert rate == 8 / 4.0
