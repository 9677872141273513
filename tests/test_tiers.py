"""Every test is in exactly one tier (tests/conftest.py ``tier_of``; README "Tests"): ``unit`` runs
with no stack, ``stack`` starts one or waits on kills and time limits, ``stress`` is opt-in."""

from __future__ import annotations

import pytest

from tests.conftest import TESTS, TIERS, TierError, tier_of


@pytest.mark.parametrize(("path", "marked", "tier"), [
    ("e2e/test_faults.py", set(), "stack"),
    ("stress/test_soak.py", {"stress", "timeout"}, "stress"),
    ("web/api/test_jobs_api.py", set(), "unit"),
    ("test_layers.py", set(), "unit"),
    ("workers/test_held_messages.py", {"stack"}, "stack"),
    ("e2e/test_helpers.py", {"unit"}, "unit"),
])
def test_a_test_is_in_its_directorys_tier_unless_it_says_otherwise(path, marked, tier):
    assert tier_of(TESTS / path, marked, set()) == tier


def test_a_test_in_two_tiers_is_refused():
    with pytest.raises(TierError, match="exactly one"):
        tier_of(TESTS / "web/test_x.py", {"unit", "stack"}, set())


@pytest.mark.parametrize("fixture", ["stack", "stack_env"])
def test_a_unit_test_asking_for_the_stack_is_refused(fixture):
    with pytest.raises(TierError, match="mark it stack"):
        tier_of(TESTS / "web/test_x.py", set(), {"redis_url", fixture})
    assert tier_of(TESTS / "web/test_x.py", {"stack"}, {fixture}) == "stack"


def test_every_collected_test_carries_one_tier(request):
    tiers = {item.nodeid: {m.name for m in item.iter_markers()} & set(TIERS) for item in request.session.items}
    assert {nodeid: names for nodeid, names in tiers.items() if len(names) != 1} == {}
