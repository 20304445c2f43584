"""What ./ops/compose-test asks of a running compose stack, over its published HTTP port.

Each subcommand prints one JSON object on stdout and exits non-zero with the reason on stderr
when the stack answers wrongly. Requests use greedy decoding (temperature 0), so an answer is a
function of its prompt and two runs compare exactly, also across a worker failover (a peer
re-prefills prompt + published tokens; tests/determinism.py pins that this changes no token).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

MODEL = "smollm2"
PROMPT = "Write a long story about a lighthouse keeper and a storm."


def _chat_body(max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _sse(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event name, data) per SSE frame."""
    event: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield event, "\n".join(data)
            event, data = None, []


def _fail(message: str, **detail: Any) -> None:
    print(json.dumps({"error": message, **detail}), file=sys.stderr)
    sys.exit(1)


def _check(ok: bool, message: str, **detail: Any) -> None:
    if not ok:
        _fail(message, **detail)


def first_answer(base: str, timeout_s: float) -> dict[str, Any]:
    """Poll a Chat request until one is answered (the time from `up` is the caller's)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{base}/v1/chat/completions", json=_chat_body(8, False), timeout=60)
            if r.status_code == 200:
                text = r.json()["choices"][0]["message"]["content"]
                _check(bool(text.strip()), "empty first answer", body=r.json())
                return {"first_answer": text}
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(1)
    _fail("no answer", last=last)
    raise AssertionError  # unreachable: _fail exits


def formats(base: str) -> dict[str, Any]:
    """A Chat, a streamed Responses and an Anthropic request, each a real, non-empty answer."""
    chat = httpx.post(f"{base}/v1/chat/completions", json=_chat_body(24, False), timeout=120)
    _check(chat.status_code == 200, "chat failed", body=chat.text)
    chat_text = chat.json()["choices"][0]["message"]["content"]
    rid = chat.headers["x-request-id"]
    body = {
        "model": MODEL,
        "input": PROMPT,
        "max_output_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    deltas: list[str] = []
    completed: dict[str, Any] = {}
    with httpx.stream("POST", f"{base}/v1/responses", json=body, timeout=120) as r:
        _check(r.status_code == 200, "responses failed", status=r.status_code)
        for event, data in _sse(r):
            frame = json.loads(data)
            if event == "response.output_text.delta":
                deltas.append(frame["delta"])
            elif event in ("response.completed", "response.incomplete"):
                completed = frame["response"]
    _check(bool(completed), "the Responses stream had no terminal event")
    streamed = "".join(deltas)
    _check(bool(streamed.strip()), "empty Responses stream")
    messages = httpx.post(
        f"{base}/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 24,
            "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}],
        },
        headers={"anthropic-version": "2023-06-01"},
        timeout=120,
    )
    _check(messages.status_code == 200, "anthropic failed", body=messages.text)
    anthropic_text = "".join(b["text"] for b in messages.json()["content"] if b["type"] == "text")
    _check(bool(anthropic_text.strip()), "empty Anthropic answer")
    # One model, greedy, the same prompt and budget: the three formats carry one answer.
    _check(chat_text == anthropic_text, "chat and anthropic differ", a=chat_text, b=anthropic_text)
    return {
        "chat": chat_text,
        "chat_request": rid,
        "responses": streamed,
        "response_id": completed["id"],
        "anthropic": anthropic_text,
    }


def failover(base: str, max_tokens: int, kill_after: int, kill_cmd: str) -> dict[str, Any]:
    """Stream a long greedy answer, kill its worker mid-stream, and compare with an unkilled run.

    The stream must end with its own finish (no error), carry exactly the reference text and
    report the same completion token count.
    """
    ref = httpx.post(f"{base}/v1/chat/completions", json=_chat_body(max_tokens, False), timeout=300)
    _check(ref.status_code == 200, "reference failed", body=ref.text)
    expected = ref.json()["choices"][0]["message"]["content"]
    expected_tokens = ref.json()["usage"]["completion_tokens"]
    parts: list[str] = []
    finish, usage, chunks, killed = None, None, 0, ""
    url = f"{base}/v1/chat/completions"
    with httpx.stream("POST", url, json=_chat_body(max_tokens, True), timeout=300) as r:
        _check(r.status_code == 200, "stream failed", status=r.status_code)
        rid = r.headers["x-request-id"]
        for _, data in _sse(r):
            if data == "[DONE]":
                break
            frame = json.loads(data)
            _check("error" not in frame, "the stream ended in an error", frame=frame)
            for choice in frame.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
            usage = frame.get("usage") or usage
            chunks += 1
            if chunks == kill_after:
                env = {**os.environ, "RID": rid}
                out = subprocess.run(kill_cmd, shell=True, env=env, capture_output=True, text=True)
                _check(out.returncode == 0, "the kill command failed", stderr=out.stderr)
                killed = out.stdout.strip()
    _check(bool(killed), f"the stream ended after {chunks} chunks, before the kill")
    text = "".join(parts)
    _check(text == expected, "the failed-over stream differs", got=text, expected=expected)
    _check(finish == ref.json()["choices"][0]["finish_reason"], "finish reason", finish=finish)
    _check(
        usage is not None and usage["completion_tokens"] == expected_tokens,
        "token count",
        usage=usage,
        expected=expected_tokens,
    )
    return {
        "request": rid,
        "killed": killed,
        "killed_after_chunk": kill_after,
        "chunks": chunks,
        "tokens": expected_tokens,
        "finish_reason": finish,
        "text": text,
    }


def stored(base: str, response_id: str, request_id: str, text: str) -> dict[str, Any]:
    """A stored response and a recorded chat stream still replay (after a Redis restart)."""
    r = httpx.get(f"{base}/v1/responses/{response_id}", timeout=30)
    _check(r.status_code == 200, "stored response lost", status=r.status_code, body=r.text)
    deltas: list[str] = []
    url = f"{base}/v1/requests/{request_id}/events"
    with httpx.stream("GET", url, timeout=30) as events:
        _check(events.status_code == 200, "event log lost", status=events.status_code)
        kinds = []
        for event, data in _sse(events):
            kinds.append(event)
            if event == "text":
                deltas.append(json.loads(data)["text"])
    _check("".join(deltas) == text, "replayed text differs", got="".join(deltas), expected=text)
    _check(kinds[-1] == "finish", "replay has no finish", kinds=kinds)
    return {"response_status": r.json()["status"], "replayed_events": len(kinds)}


def main() -> None:
    """Run one subcommand against --base."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("first-answer").add_argument("--timeout", type=float, default=600)
    sub.add_parser("formats")
    fo = sub.add_parser("failover")
    fo.add_argument("--max-tokens", type=int, default=160)
    fo.add_argument("--kill-after", type=int, default=20)
    fo.add_argument("--kill-cmd", required=True)
    st = sub.add_parser("stored")
    st.add_argument("response_id")
    st.add_argument("request_id")
    st.add_argument("text")
    args = parser.parse_args()
    base = args.base.rstrip("/")
    if args.command == "first-answer":
        result = first_answer(base, args.timeout)
    elif args.command == "formats":
        result = formats(base)
    elif args.command == "failover":
        result = failover(base, args.max_tokens, args.kill_after, args.kill_cmd)
    else:
        result = stored(base, args.response_id, args.request_id, args.text)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
