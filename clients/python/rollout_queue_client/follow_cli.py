"""``rollout-queue follow JOB_ID``: a job's events in the terminal as they happen.

The generated text goes to stdout as it streams (``--tokens``: the token ids instead); the job's
moves (queued, generating, ...), a redo after a worker failure, and the finish go to stderr, so
stdout is exactly the output. ``--url`` and ``--api-key`` default to ``ROLLOUT_URL`` and
``ROLLOUT_API_KEY`` (``rollout_queue_client.settings``). Exit status: 0 the job succeeded, 1 it ended failed or
cancelled, 2 the service refused or could not be reached.
"""

from __future__ import annotations

import sys

from .client import RolloutClient
from .errors import ClientError
from .settings import ClientSettings


def add_follow_command(subparsers, settings: ClientSettings | None = None) -> None:
    settings = settings or ClientSettings.from_env()
    follow = subparsers.add_parser("follow", help="follow a job's events (its tokens as they are generated)")
    follow.add_argument("job_id")
    follow.add_argument("--tokens", action="store_true", help="print token ids instead of text")
    follow.add_argument("--last-event-id", help="resume after this event id")
    follow.add_argument("--url", default=settings.url, help="the service (default: $ROLLOUT_URL, else %(default)s)")
    follow.add_argument("--api-key", default=settings.api_key, help="API key (default: $ROLLOUT_API_KEY)")
    follow.set_defaults(handler=follow_command)


def follow_command(args, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        with RolloutClient(args.url, args.api_key) as client:
            stream = client.stream(args.job_id, last_event_id=args.last_event_id)
            for event in stream:
                kind, data = event["event"], event["data"]
                if kind == "status":
                    print(f"[{data['status']}]", file=err, flush=True)
                elif kind == "restart":
                    print(f"\n[restart: attempt {data['attempt']}, the output so far is void]", file=err, flush=True)
                elif kind == "tokens":
                    for choice in data["choices"]:
                        if args.tokens or "text" not in choice:
                            out.write("".join(f"{t} " for t in choice["token_ids"]))
                        else:
                            out.write(choice["text"])
                    out.flush()
            result = stream.result or {}
            reasons = [c.get("finish_reason") for c in (result.get("result") or {}).get("choices") or []]
            print(f"\n[{result.get('status')}: finish_reason {', '.join(map(str, reasons)) or '-'}]", file=err)
            return 0 if result.get("status") == "succeeded" else 1
    except ClientError as error:
        print(f"rollout-queue: error: {error}", file=err)
        return 1 if error.status is None and error.code not in ("connection_error",) else 2
