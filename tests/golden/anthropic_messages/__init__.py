"""Golden Anthropic SSE transcripts (``*.sse``) and a strict, Claude Code-style consumer."""
