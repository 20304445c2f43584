"""The agent-sessions workload (``agent_sessions.py``): one long system prompt with tools that
every session shares, each turn's own words, and the streaming Chat body both servers get.

Text is words from a fixed vocabulary and seed, so every run (and both servers) sees the same
prompts, and each session's turns are its own from their first token on.
"""

from __future__ import annotations

import random
from typing import Any

_VOCAB = (
    "the a of to and in for on with as by from that this each when then only never always "
    "file line test build branch commit change review error value result request response "
    "server client cache token model queue worker stream batch step function schema field "
    "user agent tool call answer question check update read write search list run keep send "
    "first last next small large fast slow new old same other every short long clear exact "
    "project module package path config option default limit budget timeout retry report "
    "before after while until unless because careful simple correct useful"
)
WORDS = _VOCAB.split()
SYSTEM_WORDS, TURN_WORDS, LONG_WORDS = 2690, 215, 5430  # ~3,000 / ~250 / ~6,000 SmolLM2 tokens


def words(seed: str, n: int) -> str:
    """``n`` words of sentence-like text, the same for the same seed."""
    rng, out = random.Random(seed), list[str]()
    while len(out) < n:
        sentence = rng.choices(WORDS, k=rng.randint(6, 14))
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out[:n])


def system_prompt() -> str:
    rules = words("system", SYSTEM_WORDS)
    return f"You are a careful coding agent working in a user's repository.\n\n{rules}"


def _tool(name: str, about: str, **props: str) -> dict[str, Any]:
    schema = {k: {"type": "string", "description": v} for k, v in props.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": about,
            "parameters": {"type": "object", "properties": schema, "required": list(props)[:1]},
        },
    }


TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="relative path", lines="a:b range"),
    _tool("write_file", "Replace a file's contents.", path="relative path", content="new text"),
    _tool("search_code", "Regex search over the tree.", pattern="regex", glob="file filter"),
    _tool("run_tests", "Run the test suite or a part.", selector="pytest node id or -k text"),
    _tool("list_directory", "List a folder.", path="relative path", depth="levels to show"),
    _tool("git_diff", "Show the uncommitted change.", path="limit to this path"),
    _tool("http_get", "Fetch a URL's text.", url="absolute URL", max_bytes="truncate after"),
]


def turn_text(session: int, turn: int) -> str:
    """Turn ``turn`` of ``session``: its own words from its first token on."""
    body = words(f"{session}-{turn}", TURN_WORDS)
    if turn % 2:  # what an agent loop sends back after a tool ran
        return f"Tool result {session}.{turn} (search_code): matches follow.\n{body}"
    return f"Session {session}, turn {turn}: {body} Please go on with the task."


def request(
    model: str, messages: list[dict[str, str]], tokens: int, tools: bool = True
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        **({"tools": TOOLS} if tools else {}),
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
