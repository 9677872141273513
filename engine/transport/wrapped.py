"""The opaque stand-in for a feature tensor after the transport wrap.

Wrapping is the last step of finalizing an item (docs/architecture.md, "Finalize wraps last"): after it nothing may index, slice,
reshape or compute on the feature. A wrapped feature therefore refuses every tensor operation
with :class:`WrappedFeatureAccessError` instead of failing later in a confusing way; only its
metadata (kind, dtype, shape, nbytes) and its JSON-safe handle are readable.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from engine.errors import WrappedFeatureAccessError

from .codec import parse_dtype


class WrappedFeature:
    __slots__ = ("_handle",)

    def __init__(self, handle: dict[str, Any]):
        if not isinstance(handle, dict) or not isinstance(handle.get("kind"), str):
            raise TypeError("WrappedFeature needs a transport handle dict with a 'kind'")
        self._handle = handle

    @property
    def handle(self) -> dict[str, Any]:
        """The JSON-safe handle the consumer opens with ``open_feature`` (do not mutate)."""
        return self._handle

    @property
    def kind(self) -> str:
        return self._handle["kind"]

    @property
    def nbytes(self) -> int:
        return self._handle["nbytes"]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._handle["shape"])

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self._handle["dtype"])

    def __repr__(self) -> str:
        return (
            f"WrappedFeature(kind={self.kind!r}, dtype={self._handle['dtype']}, "
            f"shape={tuple(self._handle['shape'])}, nbytes={self.nbytes})"
        )

    def __eq__(self, other: object) -> bool:
        # Handle identity, so dataclasses holding wrapped features still compare; never elementwise.
        return isinstance(other, WrappedFeature) and other._handle == self._handle

    __hash__ = None  # type: ignore[assignment]  # the handle dict is mutable

    def _refuse(self, what: str) -> NoReturn:
        raise WrappedFeatureAccessError(
            f"{what} on a feature wrapped for transport ({self!r}); reshape and slice before the "
            "wrap, or open the handle with engine.transport.open_feature first"
        )

    # torch functions (torch.cat, torch.stack, F.pad, ...) on a wrapped feature land here.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None) -> NoReturn:
        wrapped = next((a for a in _flatten(args, kwargs) if isinstance(a, WrappedFeature)), None)
        name = getattr(func, "__name__", str(func))
        if wrapped is None:  # pragma: no cover - torch only dispatches here when one is present
            raise WrappedFeatureAccessError(f"torch.{name} on a wrapped feature")
        wrapped._refuse(f"torch.{name}")

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the class does not define. Tensor methods get the clear
        # error; private and dunder probes (copy, pickle, hasattr) keep normal AttributeError.
        if not name.startswith("_") and hasattr(torch.Tensor, name):
            self._refuse(f".{name}")
        raise AttributeError(name)


def _flatten(args: Any, kwargs: Any):
    stack = [args, kwargs or {}]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            yield item


def _refusing(what: str):
    def method(self: WrappedFeature, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse(what)

    method.__name__ = what
    return method


# Python's protocol methods are looked up on the type, so __getattr__ cannot catch them: indexing,
# slicing, len, iteration, truthiness, conversions and arithmetic are refused one by one.
_PROTOCOLS = {
    "__getitem__": "indexing or slicing",
    "__setitem__": "item assignment",
    "__len__": "len()",
    "__iter__": "iteration",
    "__contains__": "'in'",
    "__bool__": "truth testing",
    "__array__": "numpy conversion",
    "__index__": "use as an index",
    "__int__": "int()",
    "__float__": "float()",
}
for _name, _what in _PROTOCOLS.items():
    setattr(WrappedFeature, _name, _refusing(_what))
for _op in "add sub mul matmul truediv floordiv mod pow lshift rshift and or xor".split():
    for _form in (f"__{_op}__", f"__r{_op}__", f"__i{_op}__"):
        setattr(WrappedFeature, _form, _refusing("arithmetic"))
for _name in ("__neg__", "__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(WrappedFeature, _name, _refusing("arithmetic"))
del _name, _what, _op, _form
