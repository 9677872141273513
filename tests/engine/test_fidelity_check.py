"""The load-time fidelity check (engine/fidelity.py): every demo architecture passes it, and a model
whose teacher-forced or decode logits disagree with its own forward is refused, saying which path."""

from __future__ import annotations

import pytest
import torch

from engine.errors import Fault, ModelFidelityError
from engine.fidelity import check_fidelity, default_tolerance
from engine.generation import Engine
from engine.loading import load_model
from tests.fidelity import demo_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return demo_dirs(tmp_path_factory.mktemp("fidelity-check-models"))


def test_every_demo_architecture_passes(dirs):
    for registered, directory in sorted(dirs.items()):
        report = check_fidelity(Engine(load_model(str(directory), device="cpu")))
        assert report.tokens == 4, registered
        assert max(report.generation, report.scoring) <= 1e-5, (registered, report)
        assert report.tolerance == default_tolerance(torch.float32)


def _perturb(model, when):
    """Shift the logits of the forwards ``when(kwargs)`` selects (a model broken on one path only)."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if when(kwargs):
            out.logits = out.logits + torch.linspace(0, 2, out.logits.shape[-1], device=out.logits.device)
        return out

    model.forward = forward


@pytest.mark.parametrize(("path", "when"), [
    ("scoring", lambda kwargs: kwargs.get("use_cache") is False),  # teacher-forced only
    ("generation", lambda kwargs: kwargs.get("cache") is not None),  # decode steps only
])
def test_a_model_that_disagrees_on_one_path_is_refused_and_the_error_says_which(path, when, demo_model_dir):
    loaded = load_model(str(demo_model_dir), device="cpu")
    _perturb(loaded.model, when)
    with pytest.raises(ModelFidelityError) as caught:
        check_fidelity(Engine(loaded))
    error = caught.value
    assert error.code == "model_fidelity_failed" and error.fault is Fault.UNAVAILABLE
    assert path in error.errors and error.errors[f"{path}_max_diff"] > error.errors["tolerance"]
    assert "takes no work" in error.message


def test_the_tolerance_is_a_setting(demo_model_dir):
    loaded = load_model(str(demo_model_dir), device="cpu")
    _perturb(loaded.model, lambda kwargs: kwargs.get("use_cache") is False)
    assert check_fidelity(Engine(loaded), tolerance=100).scoring > 0.01  # loose enough to pass
