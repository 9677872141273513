"""Importing the ``engine`` and ``processors`` packages, or a torch-free module of the engine,
loads no torch: the API process imports ``engine.errors`` and ``engine.request_rules`` and must
never pay for torch (tests/web/test_torch_free_api.py checks the whole API)."""

from __future__ import annotations

import subprocess
import sys


def test_the_packages_and_the_torch_free_modules_load_no_torch():
    code = ("import sys, engine, processors, engine.errors, engine.request_rules\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
