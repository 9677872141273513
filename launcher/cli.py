"""The ``rollout-queue`` command: ``up`` runs the whole stack; ``api`` and ``worker KIND`` run parts.

Every failure a user can cause (a bad setting, an unreachable Redis, a missing model, a port in
use) ends in one clear line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from domain.infra.heartbeats import WORKER_KINDS
from engine.errors import RolloutError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (RolloutError, OSError) as error:
        print(f"rollout-queue: error: {getattr(error, 'message', None) or error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The command line and its subcommands (deployment files are checked against it)."""
    parser = argparse.ArgumentParser(prog="rollout-queue", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="start Redis (embedded unless ROLLOUT_REDIS_URL), the API and every worker")
    commands.add_parser("api", help="serve the HTTP API (needs ROLLOUT_REDIS_URL)")
    worker = commands.add_parser("worker", help="run one kind of Celery worker (needs ROLLOUT_REDIS_URL)")
    worker.add_argument("kind", choices=WORKER_KINDS)
    try:
        from rollout_queue_client.batch_cli import add_batch_commands
    except ImportError:  # only when the client package is not installed
        add_batch_commands = None
    if add_batch_commands:
        add_batch_commands(commands)
    try:
        from rollout_queue_client.follow_cli import add_follow_command
    except ImportError:  # only when the client package is not installed
        add_follow_command = None
    if add_follow_command:
        add_follow_command(commands)
    return parser


def _run(args) -> int:
    if getattr(args, "handler", None):  # batch subcommands talk to a running service
        return args.handler(args)
    from domain.infra.logs import configure_logging
    from domain.settings import load_settings

    settings = load_settings()
    configure_logging(settings.log_level)
    if args.command == "up":
        from launcher.stack import run_stack

        return run_stack(settings)
    redis_url = _require_redis(settings)
    if args.command == "api":
        from web.serving.allocator import return_large_blocks
        from web.serving.server import ApiServer

        return_large_blocks()  # before gunicorn forks its workers: they inherit it
        ApiServer(settings, redis_url).run()
        return 0
    from workers.worker_main import run_worker

    run_worker(args.kind, settings, redis_url)
    return 0


def _require_redis(settings) -> str:
    from domain.settings import SettingsError

    if not settings.redis_target:
        raise SettingsError("ROLLOUT_REDIS_URL or ROLLOUT_REDIS_SENTINELS is required here (or use 'rollout-queue up')")
    return settings.redis_target


if __name__ == "__main__":
    sys.exit(main())
