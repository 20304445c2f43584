"""Failover without repeated text: a continuation resumes exactly where the published stream ends.

A lost worker published some prefix of a stream (whole events). The continuation feeds the
published token ids to a fresh ``OutputDecoder`` through ``resume`` and keeps generating. For
every cut point, including cuts inside a held-back region (half of a multi-byte character, a
possible stop-string prefix), the published prefix plus the continuation must equal the
uninterrupted stream in text and token ids, and pass ``check_stream``. Checked on the decoder
alone and through the real scheduler thread with a scripted model double.
"""

from __future__ import annotations

import torch

from services.worker.kv_cache import AttentionBatch, PagedKVCache
from services.worker.loaders import LoadedModel, build_card
from services.worker.parsing.decoder import OutputDecoder
from services.worker.torch_backend import TorchBackend
from shared.accumulate import fold
from shared.events import AnyEvent, Start
from shared.jobs import GenerateRequest, Job, SamplingParams
from tests.forced_model import ForcedSequenceModel
from tests.invariants import check_stream, generated_token_ids
from tests.unit.worker.decoder_harness import TOK, WEATHER, drive, ids, make_card, make_job
from tests.worker_models import CHAT_TEMPLATE

torch.set_num_threads(1)


def token(text: str) -> int:
    """The id of an added token (a marker or the end of turn)."""
    found = TOK.token_to_id(text)
    assert found is not None, text
    return found


EOS, THINK, END_THINK = token("<|im_end|>"), token("<think>"), token("</think>")
CALL, END_CALL = token("<tool_call>"), token("</tool_call>")

# "🙂" is three byte-level tokens here; "3, 4!" makes "3, " and "3, 4" possible stop prefixes.
SCRIPT_TEXT = "Café 🙂 1, 2, 3, 5, 3, 4 3, 4 end"
STOPS = ["3, 4!"]


def run_decoder(script: list[int], job: GenerateRequest, resume: list[int]) -> list[list[AnyEvent]]:
    """Drive a decoder the way the engine does; return the batches one publish each sends.

    With ``resume`` it plays the continuation: those ids are restored, then the rest of the
    script is fed. The same prompt accounting as ``drive``, so Usage compares equal.
    """
    decoder = OutputDecoder(
        tokenizer=TOK, card=make_card(), job=job, prompt_tokens=7, cached_tokens=2
    )
    decoder.resume(resume)
    batches: list[list[AnyEvent]] = [
        [Start(request_id=job.request_id, model="tiny", prompt_tokens=7)]
    ]
    for token in script[len(resume) :]:
        if batch := decoder.feed(token):
            batches.append(batch)
        if decoder.stop_reason is not None:
            break
    batches.append(decoder.finish(decoder.stop_reason or "max_tokens"))
    return batches


def flat(batches: list[list[AnyEvent]]) -> list[AnyEvent]:
    return [e for batch in batches for e in batch]


def assert_every_cut_resumes_exactly(script: list[int], job: GenerateRequest) -> int:
    """Cut the uninterrupted stream after each published batch; return the cuts tried.

    A worker publishes one step's events atomically, so a lost worker's stream ends on a batch
    boundary; the last batch (Usage + Finish) ends the stream and leaves nothing to resume.
    """
    batches = run_decoder(script, job, [])
    full = flat(batches)
    assert full == drive(script, job=job)  # the same stream as the shared harness
    for k in range(1, len(batches) - 1):
        published = flat(batches[: k + 1])
        rest = flat(run_decoder(script, job, generated_token_ids(published)))
        joined = published + rest[1:]  # the job function drops the second Start
        check_stream(joined)
        assert generated_token_ids(joined) == generated_token_ids(full), k
        assert fold(joined) == fold(full), f"cut after batch {k}"
    return len(batches) - 2


def test_held_back_text_is_not_repeated_after_any_cut() -> None:
    script = [*ids(SCRIPT_TEXT), EOS]
    job = make_job(stop=STOPS, tools=[])
    full = drive(script, job=job)
    assert fold(full).text == SCRIPT_TEXT
    assert assert_every_cut_resumes_exactly(script, job) >= 8


def test_a_stop_string_completed_after_the_cut_still_stops() -> None:
    script = [*ids("ab 3, 4 3, 4! tail"), EOS]
    job = make_job(stop=STOPS, tools=[])
    assert fold(drive(script, job=job)).text == "ab 3, 4 "
    assert assert_every_cut_resumes_exactly(script, job) >= 2


def test_reasoning_and_tool_call_state_survive_a_cut() -> None:
    """Cuts inside reasoning and between calls keep the channel, indexes and call ids."""
    call = '{"name": "get_weather", "arguments": {}}'
    script = [THINK, *ids("Hmm 🙂 ok"), END_THINK, *ids("Sure."), CALL, *ids(call), END_CALL]
    script += [CALL, *ids(call), END_CALL, EOS]
    job = make_job(tools=[WEATHER])
    done = fold(drive(script, job=job))
    assert done.reasoning == "Hmm 🙂 ok" and len(done.tool_calls) == 2
    assert assert_every_cut_resumes_exactly(script, job) >= 6


# -- through the scheduler thread --------------------------------------------------------------

PROMPT = [5, 6, 7, 8]


class PositionScriptModel(ForcedSequenceModel):
    """Forces ``script[i]`` as the i-th generated token, whatever was prefilled before it.

    Unlike its parent it keys on the absolute position (the prompt length is fixed), so a
    continuation that prefills prompt + published tokens gets the same next tokens.
    """

    def forward(
        self, idx: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """Return (m, V) logits whose winner is the script token for the next position."""
        out = torch.full((batch.logit_rows.numel(), self.config.vocab_size), -10.0)
        wanting = [s for s in batch.seqs if s.logits]
        for row, s in enumerate(wanting):
            k = s.start + s.count - len(PROMPT)
            out[row, self.script[k] if 0 <= k < len(self.script) else self.end_id] = 10.0
        return out


def scripted_backend() -> TorchBackend:
    """The real engine over ``PositionScriptModel`` playing ``SCRIPT_TEXT``.

    It uses the decoder tests' tokenizer: its merged tokens (" 3", " 4") are what let a stop
    prefix end in the middle of a token, so a published token's text can be held back.
    """
    tk = TOK
    card = build_card(
        name="scripted",
        architecture="forced",
        context_length=256,
        tokenizer=tk,
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token="<|im_end|>",
        eos_token_ids=[EOS],
        add_bos_token=False,
        source="test",
    )
    model = PositionScriptModel(ids(SCRIPT_TEXT), tk.get_vocab_size(), end_id=EOS)
    loaded = LoadedModel(
        model=model,  # type: ignore[arg-type]  # a double with the model's call signature
        tokenizer=tk,
        card=card,
        device=torch.device("cpu"),
        dtype=torch.float32,
        load_seconds=0.0,
    )
    return TorchBackend(loaded, max_batch=2)


async def collect(b: TorchBackend, job: Job, resume: list[int]) -> list[list[AnyEvent]]:
    batches: list[list[AnyEvent]] = []
    async for batch in b.generate(job, resume, 2 if resume else 1):
        batches.append(batch)
    check_stream(flat(batches))
    return batches


async def test_engine_continuation_equals_the_uninterrupted_stream() -> None:
    scripted = scripted_backend()
    job = Job(
        request_id="r1",
        model="scripted",
        prompt_token_ids=PROMPT,
        prompt_text="",
        stop=STOPS,
        max_tokens=64,
        sampling=SamplingParams(temperature=0.0),
    )
    await scripted.start()
    try:
        batches = await collect(scripted, job, [])
        full = flat(batches)
        assert fold(full).text == SCRIPT_TEXT
        assert len(batches) > 8
        for k in range(1, len(batches)):  # every cut but after the final batch
            published = flat(batches[:k])
            # A different worker continues: nothing of this prompt is in its cache.
            scripted.scheduler.clear_prefix_cache()
            rest = flat(await collect(scripted, job, generated_token_ids(published)))
            assert isinstance(rest[0], Start) and rest[0].attempt == 2
            joined = published + [e for e in rest if not isinstance(e, Start)]
            check_stream(joined)
            assert generated_token_ids(joined) == generated_token_ids(full), k
            assert fold(joined) == fold(full), f"cut after batch {k}"
    finally:
        await scripted.stop()
