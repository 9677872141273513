"""The one way a benchmark module run on its own prints its rows (``bench/run_all.py`` makes the
table of all of them)."""

from __future__ import annotations


def print_rows(rows: list[dict]) -> None:
    """``rows`` (``{"name", "value", "goal", ...}``) as aligned columns: figure, value, goal."""
    width = max(len(row["name"]) for row in rows)
    print(f"{'figure':<{width}}  {'value':>10}  goal")
    for row in rows:
        print(f"{row['name']:<{width}}  {row['value']:>10}  {row['goal'] or ''}")
