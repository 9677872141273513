"""Every Redis key of batches, uploaded files and the per-key input cap, built in one place: the
stores use these, and so does the input cap's Lua script (``domain.batches.stored_input``), which
gets them as templates rather than spelling them again."""

from __future__ import annotations


def batch_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}"


def lines_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}:lines"


def jobs_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}:jobs"


def done_key(batch_id: str) -> str:
    """The batch's wake-up list: one entry once it has ended (domain.infra.wakeups)."""
    return f"rq:batch:{batch_id}:done"


def ended_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}:ended"


def output_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}:output"


def errors_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}:errors"


def owner_index_key(owner: str) -> str:
    return f"rq:batches:{owner}"


def submitted_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}:submitted"


def scoring_key(batch_id: str) -> str:
    return f"rq:batch:{batch_id}:scoring"


OPEN_KEY = "rq:batches:open"


def file_key(file_id: str) -> str:
    return f"rq:file:{file_id}"


def data_key(file_id: str) -> str:
    return f"rq:file:{file_id}:data"


def owner_files_key(owner: str) -> str:
    return f"rq:files:{owner}"


def owner_input_key(owner: str) -> str:
    return f"rq:batch-input:{owner}"
