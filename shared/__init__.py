"""sluice's contract: events, job payload, codec, Redis keys, errors, settings.

No I/O at import, no torch, no FastAPI: both services import this package.
"""
