"""The sweep of segments whose producer died (engine.transport.shm.sweep_orphaned_segments)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.transport import sweep_orphaned_segments

SHM = Path("/dev/shm")
PREFIX = "rqsweeptest_"  # not the service's prefix: other tests' segments are left alone

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_orphans_are_removed_even_empty_ones_and_live_producers_keep_theirs():
    dead = dead_pid()
    empty = SHM / f"{PREFIX}{dead}_empty"  # a producer killed between creating and sizing it
    empty.touch()
    sized = SHM / f"{PREFIX}{dead}_sized"
    sized.write_bytes(b"\0" * 4096)
    live = SHM / f"{PREFIX}{os.getpid()}_live"
    live.write_bytes(b"\0" * 4096)
    try:
        assert sorted(sweep_orphaned_segments(prefix=PREFIX)) == sorted([empty.name, sized.name])
        assert not empty.exists() and not sized.exists() and live.exists()
    finally:
        for path in (empty, sized, live):
            path.unlink(missing_ok=True)
