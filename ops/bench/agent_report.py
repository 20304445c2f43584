"""The markdown tables ``agent_sessions`` prints from its rows: every server and level, the
issue's targets at each level, and the decode-stall measurement (``--chunked``)."""

from __future__ import annotations

from typing import Any


def _ms(row: dict[str, Any], *keys: str) -> str:
    return " / ".join(f"{1e3 * row[k]:.0f}" for k in keys)


def _head(*columns: str) -> None:
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))


def _check(name: str, value: float | None, limit: float, below: bool) -> str:
    if value is None:
        return f"| {name} | - | - |"
    ok = value <= limit if below else value >= limit
    sign = "<=" if below else ">="
    return f"| {name} | {value:.2f} ({sign} {limit}) | {'pass' if ok else 'FAIL'} |"


def summarize(rows: list[dict[str, Any]]) -> None:
    """Markdown tables: every server and level, then the targets at each level."""
    _head("S", "server", "turn-1 prompt tok", "TTFT turn 1 p50 / p90 ms",
          "TTFT turns 2+ p50 / p90 ms", "session wall p50 s", "out tok/s",
          "cached turns 2+: of prompt / of seen", "peak RSS GB", "errors")  # fmt: skip
    for r in rows:
        share = " / ".join(
            f"{100 * r[k]:.1f}%" if r[k] else "-" for k in ("cached_share", "cached_of_seen")
        )
        print(
            f"| {r['sessions']} | {r['server']} | {r['turn1_prompt_tokens']:.0f} "
            f"| {_ms(r, 'ttft1_p50', 'ttft1_p90')} | {_ms(r, 'ttft2_p50', 'ttft2_p90')} "
            f"| {r['session_wall_p50']:.1f} | {r['out_tok_s']:.1f} | {share} "
            f"| {r['peak_rss_bytes'] / 1e9:.2f} | {len(r['errors'])} |"
        )
    _head("S: target (the issue states the ratios at S=32)", "value", "result")
    by = {(r["server"], r["sessions"]): r for r in rows}
    for n in dict.fromkeys(r["sessions"] for r in rows):
        ours, ll, old = (by.get((s, n)) for s in ("sluice", "llama-server", "sluice-before"))
        if not ours:
            continue
        if ll:
            ratio = ours["ttft2_p50"] / ll["ttft2_p50"]
            print(_check(f"{n}: TTFT turns 2+ p50 / llama-server's", ratio, 0.5, True))
            ratio = ours["out_tok_s"] / ll["out_tok_s"]
            print(_check(f"{n}: out tok/s / llama-server's", ratio, 1.5, False))
        if old:
            ratio = ours["ttft2_p50"] / old["ttft2_p50"]
            print(_check(f"{n}: TTFT turns 2+ p50 / sluice-before's", ratio, 0.3, True))
        print(_check(f"{n}: cached share of turn-2+ prompts", ours["cached_share"], 0.95, False))
        print(_check(f"{n}: cached / seen before, turns 2+", ours["cached_of_seen"], 0.95, False))


def summarize_chunked(rows: list[dict[str, Any]]) -> None:
    """A markdown table of the decode-stall measurement (``--chunked``), a row per server."""
    _head("server", "tokens/chunk", "interval p50 / p99 / max ms", "p99 < 3x p50",
          "long prompt tok", "its TTFT s", "max interval during its prefill ms")  # fmt: skip
    for r in rows:
        print(
            f"| {r['server']} | {r['tokens_per_chunk']:.2f} "
            f"| {_ms(r, 'interval_p50', 'interval_p99', 'interval_max')} "
            f"| {'pass' if r['p99_under_3x_p50'] else 'FAIL'} | {r['long_prompt_tokens']} "
            f"| {r['long_ttft']:.2f} | {1e3 * r['during_long_max']:.0f} |"
        )
