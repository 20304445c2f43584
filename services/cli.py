"""The ``sluice`` command: ``api``, ``worker``, ``up``, ``status`` and the log tools.

Each subcommand imports its service lazily, so ``sluice api`` never imports torch.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    api = sub.add_parser("api", help="serve the HTTP API (uvicorn)")
    api.add_argument("--host", default=None)
    api.add_argument("--port", type=int, default=None)
    worker = sub.add_parser("worker", help="serve one model from the Redis queue")
    worker.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF directory, 'smollm2' (default) or 'scripted:<scenario>' (test double)",
    )
    worker.add_argument("--name", default=None, help="public model id (default: derived)")
    up = sub.add_parser("up", help="Redis (if none answers) + one worker + the API")
    up.add_argument("--model", default=None)
    up.add_argument("--host", default=None)
    up.add_argument("--port", type=int, default=None)
    status = sub.add_parser("status", help="workers, queues and failovers, read from Redis")
    status.add_argument("--json", action="store_true", help="one JSON object per reading")
    status.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    export = sub.add_parser("export", help="export a request's event log to a JSONL file")
    export.add_argument("request_id")
    export.add_argument("-o", "--output", default="-")
    replay = sub.add_parser("replay", help="print a recorded or live event stream")
    replay.add_argument("source", help="a request id (live) or an exported .jsonl file")
    replay.add_argument("--realtime", action="store_true", help="keep the original timing")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sluice`` console script."""
    args = _parser().parse_args(argv)
    from shared.config import Settings

    overrides = {k: v for k, v in vars(args).items() if k in ("host", "port", "model")}
    settings = Settings.from_env(**overrides)
    if args.command == "api":
        from services.api.main import run_api

        return run_api(settings)
    if args.command == "worker":
        from services.worker.main import run_worker

        return run_worker(settings, model_spec=args.model or settings.model, name=args.name)
    if args.command == "up":
        from services.launcher import run_up

        return run_up(settings)
    if args.command == "status":
        from services.status import run_status

        return run_status(settings, watch=args.watch, as_json=args.json)
    from sluice_client import cli_export, cli_replay

    if args.command == "export":
        return cli_export(settings, args.request_id, args.output)
    return cli_replay(settings, args.source, realtime=args.realtime)


if __name__ == "__main__":
    sys.exit(main())
