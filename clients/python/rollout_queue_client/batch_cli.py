"""``rollout-queue batch ...``: submit, follow, cancel and download batches on a running service.

    rollout-queue batch submit FILE [--wait] [--output PATH] [--errors PATH]
    rollout-queue batch status ID | cancel ID | wait ID | download ID [--output PATH] [--errors PATH]
    rollout-queue batch list

These commands are a client of the HTTP API (``rollout_queue_client.RolloutClient``), not part of the service:
``--url`` and ``--api-key`` default to ``ROLLOUT_URL`` (else http://127.0.0.1:8000) and
``ROLLOUT_API_KEY``, the client's own configuration (``rollout_queue_client.settings``). Needs ``tqdm`` for the
progress bar, besides what the client needs.
Exit status: 0 done (a completed batch may still have failed lines, see its errors file), 1 the
batch ended failed, cancelled or expired, 2 the service refused or could not be reached.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .client import RolloutClient
from .errors import ClientError
from .settings import ClientSettings


def add_batch_commands(subparsers, settings: ClientSettings | None = None) -> None:
    """Add ``batch`` and its subcommands; each sets ``handler(args) -> exit status``. ``settings``
    gives the defaults of ``--url`` and ``--api-key`` (default: read from the environment)."""
    settings = settings or ClientSettings.from_env()
    batch = subparsers.add_parser("batch", help="submit, follow and download batches on a running service")
    commands = batch.add_subparsers(dest="batch_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=settings.url, help="the service (default: $ROLLOUT_URL, else %(default)s)")
    common.add_argument("--api-key", default=settings.api_key, help="API key (default: $ROLLOUT_API_KEY)")
    common.add_argument("--poll-interval", type=float, default=2.0, help="seconds between polls (default 2)")
    files = argparse.ArgumentParser(add_help=False)
    files.add_argument("--output", type=Path, help="where to write the output lines (default ID_output.jsonl)")
    files.add_argument("--errors", type=Path, help="where to write the error lines (default ID_errors.jsonl)")

    submit = commands.add_parser("submit", parents=[common, files], help="upload a JSONL file as a batch")
    submit.add_argument("file", type=Path, help="JSONL: one {custom_id, kind, body} per line")
    submit.add_argument("--wait", action="store_true", help="follow it with a progress bar, then download")
    submit.add_argument("--completion-window", help="e.g. 24h (default: the service's)")
    submit.add_argument("--metadata", type=json.loads, help="a JSON object kept with the batch")
    submit.set_defaults(handler=submit_command)

    for name, handler, text in (("status", status_command, "show a batch"),
                                ("cancel", cancel_command, "cancel a batch (finished lines are kept)")):
        command = commands.add_parser(name, parents=[common], help=text)
        command.add_argument("batch_id")
        command.set_defaults(handler=handler)
    wait = commands.add_parser("wait", parents=[common, files], help="follow a batch to its end, then download")
    wait.add_argument("batch_id")
    wait.set_defaults(handler=wait_command)
    download = commands.add_parser("download", parents=[common, files], help="download output and errors")
    download.add_argument("batch_id")
    download.set_defaults(handler=download_command)
    listing = commands.add_parser("list", parents=[common], help="your batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(handler=list_command)


def _reports_errors(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """One line on stderr and exit status 2 for what the user can fix, never a traceback."""

    @functools.wraps(handler)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ClientError as error:
            print(f"rollout-queue: error: {error}", file=sys.stderr)
        except OSError as error:  # the file to upload or a download target
            print(f"rollout-queue: error: {error}", file=sys.stderr)
        return 2

    return wrapped


@_reports_errors
def submit_command(args) -> int:
    with _client(args) as client:
        batch = client.batch_submit(args.file, completion_window=args.completion_window, metadata=args.metadata)
        invalid = batch["errors"]["invalid_lines"]
        _note(f"batch {batch['id']}: {batch['request_counts']['total']} lines"
              + (f", {invalid} invalid (see the errors file)" if invalid else ""))
        if not args.wait:
            _print(batch)
            return 0
        return _follow_and_download(client, batch["id"], args)


@_reports_errors
def wait_command(args) -> int:
    with _client(args) as client:
        return _follow_and_download(client, args.batch_id, args)


@_reports_errors
def status_command(args) -> int:
    with _client(args) as client:
        _print(client.batch_get(args.batch_id))
    return 0


@_reports_errors
def cancel_command(args) -> int:
    with _client(args) as client:
        _print(client.batch_cancel(args.batch_id))
    return 0


@_reports_errors
def download_command(args) -> int:
    with _client(args) as client:
        _download(client, args.batch_id, args)
    return 0


@_reports_errors
def list_command(args) -> int:
    with _client(args) as client:
        _print(client.batch_list(limit=args.limit))
    return 0


def follow(client: RolloutClient, batch_id: str, *, poll_interval: float = 2.0, file=None) -> dict[str, Any]:
    """Wait for the batch with a tqdm bar: lines done of total, failed, rate and time left."""
    bar: tqdm | None = None

    def progress(batch: dict[str, Any]) -> None:
        nonlocal bar
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        if bar is None:  # starts at what was done already, so the rate is of this run only
            bar = tqdm(total=counts["total"], initial=done, unit="line", desc=batch_id,
                       file=file or sys.stderr, dynamic_ncols=True)
        bar.update(done - bar.n)
        bar.set_postfix(failed=counts["failed"], status=batch["status"], refresh=True)

    try:
        return client.batch_wait(batch_id, poll_interval=poll_interval, progress=progress)
    finally:
        if bar is not None:
            bar.close()


def _follow_and_download(client: RolloutClient, batch_id: str, args) -> int:
    batch = follow(client, batch_id, poll_interval=args.poll_interval)
    _download(client, batch_id, args)
    _print(batch)
    return 0 if batch["status"] == "completed" else 1


def _download(client: RolloutClient, batch_id: str, args) -> None:
    output = args.output or Path(f"{batch_id}_output.jsonl")
    errors = args.errors or Path(f"{batch_id}_errors.jsonl")
    counts = client.batch_download(batch_id, output, errors)
    _note(f"{counts['output']} output lines -> {output}; {counts['errors']} error lines -> {errors}")


def _client(args) -> RolloutClient:
    return RolloutClient(args.url, api_key=args.api_key)


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _note(text: str) -> None:
    print(text, file=sys.stderr)


def run(argv: list[str], settings: ClientSettings | None = None) -> int:
    """``batch`` commands on their own (what ``rollout-queue batch ...`` runs), for tests and scripts."""
    parser = argparse.ArgumentParser(prog="rollout-queue")
    add_batch_commands(parser.add_subparsers(dest="command", required=True), settings)
    args = parser.parse_args(["batch", *argv])
    return args.handler(args)
