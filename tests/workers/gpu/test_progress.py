"""The GPU worker's progress stamp (workers/gpu/progress.py), read at each heartbeat: it moves with
the engine's forwards and with a held message settled, not while messages sit held."""

from __future__ import annotations

from workers.gpu.progress import ProgressStamp


def test_progress_moves_with_forwards_and_settled_messages_only():
    now = [100.0]
    stamp = ProgressStamp(clock=lambda: now[0])
    assert stamp.observe(0, ["a", "b"]) == 100.0
    now[0] = 130.0
    assert stamp.observe(0, ["a", "b"]) == 100.0  # held, nothing moved
    assert stamp.observe(0, ["a", "b", "c"]) == 100.0  # taking more is no progress
    assert stamp.observe(5, ["a", "b", "c"]) == 130.0  # a forward
    now[0] = 160.0
    assert stamp.observe(5, ["b", "c"]) == 160.0  # a message settled
    now[0] = 300.0
    assert stamp.observe(5, []) == 300.0  # idle is not stalled
