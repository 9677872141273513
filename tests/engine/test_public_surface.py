"""``engine`` and ``processors`` name what the layer above uses (``__all__``), each name loaded
from its module on first use: every name resolves to the very object its module defines, and
importing a package (or a torch-free name of it) loads no torch."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

PACKAGES = ("engine", "processors")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_its_modules_own(package):
    module = importlib.import_module(package)
    # A public name that is also a submodule's would be replaced by the module once it is imported.
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    assert not set(module.__all__) & submodules
    assert module.__all__ == sorted(module.__all__) and module.__all__
    for name in module.__all__:
        value = getattr(module, name)
        assert value is getattr(importlib.import_module(value.__module__), name), name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError):
        module.not_a_public_name  # noqa: B018


def test_the_packages_and_the_torch_free_names_load_no_torch():
    code = ("import sys, engine, processors\n"
            "engine.RolloutError, engine.context_limit, engine.Choice, processors.FetchPolicy\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
