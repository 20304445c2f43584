"""Streaming parser for tool calls written as JSON objects.

One parser covers the three styles, because they differ only in framing: Hermes/Qwen put one
``{"name": ..., "arguments": {...}}`` object between ``<tool_call>`` tokens, Mistral writes a JSON
list of such objects after ``[TOOL_CALLS]``, Llama 3 writes ``{"name": ..., "parameters": {...}}``
objects separated by ``;``. Between objects the parser skips whitespace, ``,``, ``;``, ``[`` and
``]``.

What it promises (the peers' bugs are the spec: vLLM #21544/#28806, SGLang #35564, Ollama
#16212): ``Started`` only once the name is decoded, is a declared tool, and the arguments have
begun as a JSON object, so nothing is announced as a call before it is plausibly one;
``Fragment``s that are consecutive slices of the arguments text exactly as the model wrote it
(never whitespace-only), so they always concatenate to the final arguments; ``Completed`` with
the arguments once the object closes and they parse as a JSON object. Input that cannot be a
call before ``Started`` yields ``Failed`` with the raw text, which the caller shows as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["CallParser", "Completed", "Failed", "Fragment", "JsonScanner", "Started", "Trailing"]

_HEADER = re.compile(
    r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
    r'\s*"(?:arguments|parameters)"\s*:\s*'
)
_NAME_ONLY = re.compile(
    r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)"'
)
_SEPARATORS = " \t\r\n,;[]"
_MAX_HEADER = 512  # chars without a recognisable header before we call it text


@dataclass(frozen=True)
class Started:
    """A call's name is known; ``at`` is the parser offset its start consumed up to."""

    name: str
    at: int


@dataclass(frozen=True)
class Fragment:
    """A slice of the arguments text, ending at parser offset ``at``."""

    text: str
    at: int


@dataclass(frozen=True)
class Completed:
    """The call's object closed; ``arguments`` is the complete JSON object text."""

    arguments: str
    at: int


@dataclass(frozen=True)
class Failed:
    """Not a call: ``raw`` is the text that was held for it."""

    raw: str


@dataclass(frozen=True)
class Trailing:
    """Non-JSON text after completed calls (shown as text by the caller)."""

    text: str


Action = Started | Fragment | Completed | Failed | Trailing


class JsonScanner:
    """Validates one JSON value character by character (a pushdown automaton, no allocation)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.state = "value"  # value | key | key_or_end | colon | after | value_or_end
        self.in_string = False
        self.string_is_key = False
        self.escape = 0  # 1 after a backslash, >1 while reading \\uXXXX digits
        self.literal = ""  # rest of true/false/null still expected
        self.in_number = False
        self.done = False
        self.error = False

    def feed(self, ch: str) -> None:
        """Consume one character; sets ``done`` when the top-level value closes."""
        if self.error or self.done:
            self.error = self.error or not ch.isspace()
            return
        if self.in_string:
            self._string(ch)
        elif self.literal:
            if ch != self.literal[0]:
                self.error = True
                return
            self.literal = self.literal[1:]
            if not self.literal:
                self._value_done()
        elif self.in_number and (ch.isdigit() or ch in "+-.eE"):
            return
        else:
            if self.in_number:
                self.in_number = False
                self._value_done()
                if self._finished():
                    self.error = not ch.isspace()
                    return
            self._structural(ch)

    @classmethod
    def inside_object(cls) -> JsonScanner:
        """A scanner positioned just after a ``,`` inside an object (expects a key)."""
        scanner = cls()
        scanner.stack, scanner.state = ["{"], "key"
        return scanner

    def _finished(self) -> bool:
        return self.done

    def _string(self, ch: str) -> None:
        if self.escape == 1:
            self.escape = 5 if ch == "u" else 0
            self.error = ch not in '"\\/bfnrtu'
        elif self.escape > 1:
            self.escape = self.escape - 1 if self.escape > 2 else 0
            self.error = ch not in "0123456789abcdefABCDEF"
        elif ch == "\\":
            self.escape = 1
        elif ch == '"':
            self.in_string = False
            if self.string_is_key:
                self.state = "colon"
            else:
                self._value_done()
        elif ord(ch) < 0x20:
            self.error = True

    def _structural(self, ch: str) -> None:  # noqa: C901 - one flat case per JSON state
        if ch.isspace():
            return
        state = self.state
        if state in ("value", "value_or_end"):
            if state == "value_or_end" and ch == "]":
                self._close("[")
            elif ch == "{":
                self.stack.append("{")
                self.state = "key_or_end"
            elif ch == "[":
                self.stack.append("[")
                self.state = "value_or_end"
            elif ch == '"':
                self.in_string, self.string_is_key = True, False
            elif ch in "-0123456789":
                self.in_number = True
            elif ch in "tfn":
                self.literal = {"t": "rue", "f": "alse", "n": "ull"}[ch]
            else:
                self.error = True
        elif state in ("key", "key_or_end"):
            if ch == '"':
                self.in_string, self.string_is_key = True, True
            elif state == "key_or_end" and ch == "}":
                self._close("{")
            else:
                self.error = True
        elif state == "colon":
            self.error = ch != ":"
            self.state = "value"
        elif state == "after":
            if ch == "," and self.stack:
                self.state = "key" if self.stack[-1] == "{" else "value"
            elif ch in "}]" and self.stack:
                self._close("{" if ch == "}" else "[")
            else:
                self.error = True

    def _close(self, opener: str) -> None:
        if not self.stack or self.stack[-1] != opener:
            self.error = True
            return
        self.stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if self.stack:
            self.state = "after"
        else:
            self.done = True


class CallParser:
    """Parses a run of tool-call objects from text that arrives in arbitrary pieces.

    Args:
        names: Declared tool names; a call to another name is not a call (None: accept any).
    """

    def __init__(self, names: set[str] | None) -> None:
        self.names = names
        self.buf = ""
        self.obj_start = 0  # offset where the current object (or separator run) begins
        self.pos = 0  # offset consumed by the current object's scanning
        self.started = False
        self.completed = 0  # calls completed by this parser
        self.failed = False
        self._args_start = 0
        self._emitted = 0  # offset up to which argument text was emitted
        self._scanner: JsonScanner | None = None
        self._awaiting_close = False  # arguments done, the outer "}" not yet seen
        self._tail: JsonScanner | None = None  # more keys after the arguments

    def feed(self, text: str) -> list[Action]:
        """Consume decoded text; return what it completed."""
        self.buf += text
        out: list[Action] = []
        while not self.failed:
            before = (self.pos, self.started, self._awaiting_close, self.obj_start)
            if self.started:
                self._scan(out)
            else:
                self._header(out)
            if before == (self.pos, self.started, self._awaiting_close, self.obj_start):
                break
        return out

    def _header(self, out: list[Action]) -> None:
        i = self.obj_start
        while i < len(self.buf) and self.buf[i] in _SEPARATORS:
            i += 1
        if i == len(self.buf):
            return
        if self.buf[i] != "{":
            self._fail_or_trail(out)
            return
        head = self.buf[i:]
        name_match = _NAME_ONLY.match(head)
        if name_match is None:
            closed = "}" in head
            if closed or len(head) > _MAX_HEADER or not _could_start(head):
                self._fail_or_trail(out)
            return
        name = _unescape(name_match.group(1))
        if name is None or (self.names is not None and name not in self.names):
            self._fail_or_trail(out)
            return
        match = _HEADER.match(head)
        if match is None:
            rest = head[name_match.end() :].lstrip()
            if (
                rest
                and not _prefix_of('", "arguments": '[1:], rest)
                and not _prefix_of(', "parameters": ', rest)
            ):
                self._fail_or_trail(out)
            return
        body = i + match.end()
        # The arguments must begin as an object whose next token is a key or "}".
        rest = self.buf[body:].lstrip()
        if not rest:
            return
        if rest[0] != "{":
            self._fail_or_trail(out)
            return
        inner = rest[1:].lstrip()
        if not inner:
            return
        if inner[0] not in '"}':
            self._fail_or_trail(out)
            return
        self.started = True
        self._args_start = self._emitted = self.pos = body + (len(self.buf[body:]) - len(rest))
        self._scanner = JsonScanner()
        out.append(Started(name=name, at=self._args_start))

    def _scan(self, out: list[Action]) -> None:
        scanner = self._scanner
        assert scanner is not None
        if self._awaiting_close:
            self._close_object(out)
            return
        while self.pos < len(self.buf) and not scanner.done and not scanner.error:
            scanner.feed(self.buf[self.pos])
            self.pos += 1
        if scanner.error:
            self.failed = True  # started: the caller ends generation and leaves the call open
            return
        end = self.pos
        fragment = self.buf[self._emitted : end]
        if fragment.strip():
            out.append(Fragment(text=fragment, at=end))
            self._emitted = end
        if scanner.done:
            self._awaiting_close = True

    def _close_object(self, out: list[Action]) -> None:
        """After the arguments: skip further keys (Mistral's ``"id"``) up to the outer brace."""
        while self.pos < len(self.buf):
            ch = self.buf[self.pos]
            self.pos += 1
            tail = self._tail
            if tail is not None:
                tail.feed(ch)
                if tail.done or tail.error:
                    self._complete(out)
                    return
            elif ch == "}":
                self._complete(out)
                return
            elif ch == ",":
                self._tail = JsonScanner.inside_object()
            elif not ch.isspace():
                self._complete(out)  # tolerate junk where the outer brace belongs
                self.pos -= 1
                return

    def _complete(self, out: list[Action]) -> None:
        arguments = self.buf[self._args_start : self._emitted]
        try:
            valid = isinstance(json.loads(arguments), dict)
        except ValueError:
            valid = False
        if not valid:
            self.failed = True
            return
        out.append(Completed(arguments=arguments, at=self.pos))
        self.completed += 1
        self.started = self._awaiting_close = False
        self._scanner = self._tail = None
        self.obj_start = self.pos

    def _fail_or_trail(self, out: list[Action]) -> None:
        raw = self.buf[self.obj_start :]
        self.failed = True
        out.append(Trailing(text=raw) if self.completed else Failed(raw=raw))

    def finish(self) -> list[Action]:
        """End of input: complete a call whose outer brace never came, or give back held text."""
        out: list[Action] = []
        if self.failed:
            return out
        if self.started and self._awaiting_close:
            self._complete(out)
        elif not self.started:
            raw = self.buf[self.obj_start :]
            if raw.strip(_SEPARATORS):
                self.failed = True
                out.append(Trailing(text=raw) if self.completed else Failed(raw=raw))
        return out


def _unescape(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _prefix_of(expected: str, text: str) -> bool:
    """True when text and expected agree on their common length, whitespace-insensitively."""
    a, b = "".join(expected.split()), "".join(text.split())
    return a.startswith(b) or b.startswith(a)


def _could_start(head: str) -> bool:
    """True while ``head`` may still grow into ``{"name": "`` (or ``{"type": "function", ...``)."""
    compact = "".join(head.split())
    return any(
        form.startswith(compact) or compact.startswith(form)
        for form in ('{"name":"', '{"type":"function","name":"')
    )
