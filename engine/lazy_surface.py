"""A package's public names, each loaded from its module on first use (PEP 562 ``__getattr__``):
how ``engine`` and ``processors`` name what the layer above uses without importing torch or
transformers for a caller that needs none of it.

Written here because the standard library has the hook but no helper for it, and a lazy-loader
dependency for two ``__init__.py`` files is not worth its weight."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_surface(package: str, public: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``public`` maps each name to its module."""

    def getattr_(name: str) -> object:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(public[name]), name)
        setattr(sys.modules[package], name, value)  # once loaded, an ordinary attribute
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return getattr_, dir_
