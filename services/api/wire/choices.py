"""A request's ``n`` choices as one wire answer: the merge of n event streams, for any format.

Each choice is a request of its own with its own event log (``shared.jobs.choice_id``), so each
is projected by its format's ordinary projector, told its ``index``. ``ChoiceMerge`` feeds every
event to its choice's projector and owns what belongs to the request as a whole: the usage
(after the last choice's finish, once, summed) and the end of the stream (the format's close,
once). The first ``Error`` of any choice ends the answer, as an error ends a one-choice stream:
the client's SDK raises on it, so nothing after it could be read. Choices first appear in index
order, as in OpenAI's streams (the openai SDK's accumulator relies on it): before choice i's
first frame, each earlier choice that showed nothing yet is opened (its projector's ``open``,
where the format has one). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from services.api.wire.sse import Frame
from shared.events import AnyEvent, Error, Usage, is_terminal

__all__ = ["ChoiceMerge", "ChoiceProjector", "merge_usage"]


class ChoiceProjector(Protocol):
    """One choice's projector: a wire format's ordinary ``Projector``."""

    def feed(self, event: AnyEvent) -> list[Frame]:
        """Frames for one event of this choice."""
        ...

    def close(self) -> list[Frame]:
        """The format's end of stream (e.g. ``data: [DONE]``)."""
        ...


def merge_usage(usages: Sequence[Usage | None], prompts: int = 1) -> Usage | None:
    """The usage of a request with several choices, as OpenAI counts it.

    Each prompt is read once: its tokens (and the cached ones) are those of the first choice
    of its run that reported any (one run for a one-prompt request; a legacy Completions batch
    has one run of choices per prompt). Completion and reasoning tokens are summed.

    Args:
        usages: each choice's ``Usage``, None where a choice reported none.
        prompts: how many runs of equal length the choices form, one per prompt.

    Returns:
        The request's usage, None when no choice reported any.
    """
    present = [u for u in usages if u is not None]
    if not present:
        return None
    per_prompt = max(1, len(usages) // prompts)
    runs = [usages[i : i + per_prompt] for i in range(0, len(usages), per_prompt)]
    firsts = [u for run in runs if (u := next((x for x in run if x is not None), None))]
    return Usage(
        input_tokens=sum(u.input_tokens for u in firsts),
        output_tokens=sum(u.output_tokens for u in present),
        cached_tokens=sum(u.cached_tokens for u in firsts),
        reasoning_tokens=sum(u.reasoning_tokens for u in present),
    )


class ChoiceMerge:
    """Projects the interleaved events of a request's choices into one stream of frames.

    Attributes:
        ended: every choice reached its terminal event, or one failed: nothing more is shown.
        failed: a choice ended with an ``Error`` (the others are better cancelled).
        usage: the merged usage once every choice finished (None before).
    """

    def __init__(
        self,
        choices: Sequence[ChoiceProjector],
        finale: Callable[[Usage | None], list[Frame]],
        prompts: int = 1,
    ) -> None:
        """Merge ``choices`` (one projector per choice, choice ``i`` at index ``i``).

        Args:
            choices: the choices' projectors, each built with its own index.
            finale: the frames after the last choice's finish, given the merged usage (e.g.
                Chat's usage chunk when the client asked for usage).
            prompts: the runs of choices with a prompt of their own (``merge_usage``).
        """
        self.choices = list(choices)
        self._finale = finale
        self._prompts = prompts
        self._usages: list[Usage | None] = [None] * len(choices)
        self._done = [False] * len(choices)
        self._shown = 0  # choices 0 .. _shown - 1 have had a frame out
        self._closed = False
        self.ended = False
        self.failed = False
        self.usage: Usage | None = None

    @property
    def coalesce(self) -> bool:
        """Whether a backlog of one choice's deltas may be folded (its projector's say)."""
        return bool(getattr(self.choices[0], "coalesce", False))

    def feed(self, index: int, event: AnyEvent) -> list[Frame]:
        """Project one event of choice ``index``.

        Args:
            index: the choice the event belongs to.
            event: the next event of that choice's stream.

        Returns:
            The frames to send (possibly none).
        """
        if self.ended or self._done[index]:
            return []
        if isinstance(event, Usage):
            self._usages[index] = event
        frames = self.choices[index].feed(event)
        if isinstance(event, Error):
            self.ended = self.failed = True
            return frames
        if frames and index >= self._shown:
            frames = [*self._open(index), *frames]
        if is_terminal(event):
            self._done[index] = True
            if all(self._done):
                self.ended = True
                self.usage = merge_usage(self._usages, self._prompts)
                frames += self._finale(self.usage)
        return frames

    def _open(self, index: int) -> list[Frame]:
        """Open the choices before ``index`` that showed nothing yet."""
        frames: list[Frame] = []
        for earlier in self.choices[self._shown : index]:
            if (opener := getattr(earlier, "open", None)) is not None:
                frames += opener()
        self._shown = index + 1
        return frames

    def close(self) -> list[Frame]:
        """The format's end of stream, once (every choice's projector ends the same way)."""
        if self._closed:
            return []
        self._closed = True
        return self.choices[0].close()

    def fail(self, error: Error) -> list[Frame]:
        """End the answer with ``error`` (the stream broke off) and the format's end.

        Args:
            error: the error to show.

        Returns:
            The error's frames (none if the answer already ended) and the end of stream.
        """
        frames = [] if self.ended else self.choices[0].feed(error)
        self.ended = self.failed = True
        return [*frames, *self.close()]
