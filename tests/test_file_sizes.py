"""No module of the service, its client or its benchmarks over 400 lines (docs/architecture.md,
"Where the rules live"): a file that grows past it holds more than one job and is split by job."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("launcher", "web", "workers", "domain", "processors", "engine", "bench", "clients")
MOST_LINES = 400


def test_no_module_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): lines
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if ".venv" not in path.parts and (lines := len(path.read_text().splitlines())) > MOST_LINES}
    assert long == {}, f"over {MOST_LINES} lines: split each by job"
