"""web/serving/allocator.py: large blocks a thread frees go back to the system (glibc otherwise keeps them
in the thread's arena once it has freed one such block: an unread stream's read of its result
cost the API process about twice the result again). In a child process: the setting is the
process's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import threading
from pathlib import Path
from web.serving.allocator import return_large_blocks

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

def reads():  # what a stream's thread does: a record read whole, kept a while, freed
    for _ in range(3):
        block = bytearray(16 << 20)
        small = [bytes(100) for _ in range(1000)]
        del block

if not return_large_blocks():
    raise SystemExit("unsupported")
before = rss()
for _ in range(4):
    thread = threading.Thread(target=reads)
    thread.start()
    thread.join()
print(rss() - before)
"""


def test_large_blocks_freed_by_threads_leave_the_process():
    if not Path("/proc/self/status").exists():
        pytest.skip("reads /proc")
    child = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if child.stderr.strip() == "unsupported":
        pytest.skip("no mallopt: not glibc")
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) < 4 << 20, int(child.stdout)
