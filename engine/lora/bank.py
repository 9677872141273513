"""The resident adapters of one model, applied per row: rows of different adapters and the base
run in one forward (decode steps, prefills, scoring).

How: a forward hook on each targeted ``nn.Linear`` adds the rows' LoRA products to the base
output. The adapters a forward uses (``U`` of them) are gathered once per module as one
``(U*R, in)`` A and one ``(U*R, out)`` B (each adapter's rank padded to the bank's largest ``R``
with zeros), so the product is two dense matmuls over every row: ``((x @ A^T) * mask) @ B``, where
the row mask holds the row's adapter scale in that adapter's columns and zero elsewhere. A base row
has an all-zero mask and gets exactly zero added; padded rank columns add exact zeros. This is the
batched LoRA of Punica/S-LoRA (vLLM's ``--enable-lora``) in plain torch, and it computes what PEFT
computes per adapter (``result + lora_B(lora_A(x)) * scaling``, in float32 when the base is half
precision, as PEFT's ``autocast_adapter_dtype`` does), checked against ``peft.PeftModel`` in
tests/engine/lora/.

Why not PEFT's own mixed batches (``adapter_names=``): PEFT injects ``LoraLayer`` modules in place
of the base's linears, which renames every weight (``base_layer.weight``) that weight updates,
``save_weights`` and the load-time fidelity check address by name, and its mixed batch runs one
sub-batch per adapter; a hook leaves the base model as transformers built it and costs nothing when
a forward selects no adapter.

Which rows use which adapter is set per forward by :func:`lora_rows` (thread-local: forwards of
other threads, such as the load-time check, see none).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from engine.lora.adapter_files import LoraAdapter, adaptable_modules
from engine.lora.errors import AdapterLimitError, AdapterNotFoundError


@dataclass
class _Selection:
    used: torch.Tensor  # (U,) slots this forward uses
    mask: torch.Tensor  # (rows, U*R) each row's scale in its adapter's columns
    rows: int


class AdapterBank:
    """Up to ``max_loras`` adapters resident on ``model``'s device, by id (the service's name and
    version). ``add`` and ``remove`` run between forwards (the stepping thread, or under the
    model's lock)."""

    def __init__(self, model, *, max_loras: int, max_rank: int):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.device = next(model.parameters()).device
        self._targets = adaptable_modules(model)
        self._slot: dict[str, int] = {}  # every resident adapter's slot, retired ones included
        self._live: set[str] = set()  # those new requests may name
        self._retired: list[str] = []  # resident for the rows still running under them, oldest first
        self._adapters: dict[str, LoraAdapter] = {}
        self._a: dict[str, torch.Tensor] = {}  # module -> (slots, R, in)
        self._b: dict[str, torch.Tensor] = {}  # module -> (slots, R, out)
        self._scale = torch.zeros(max_loras)
        self._rank = 0
        self._hooks: dict[str, object] = {}
        self._local = threading.local()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._live

    def ids(self) -> list[str]:
        return sorted(self._live)

    def add(self, adapter_id: str, adapter: LoraAdapter) -> None:
        """Make ``adapter`` resident as ``adapter_id`` (replacing one of that id in its slot)."""
        slot = self._slot.get(adapter_id)
        if slot is None:
            free = sorted(set(range(self.max_loras)) - set(self._slot.values()))
            if not free and self._retired:  # the adapter retired longest ago gives its slot up
                self.remove(self._retired[0])
                free = sorted(set(range(self.max_loras)) - set(self._slot.values()))
            if not free:
                raise AdapterLimitError(f"{self.max_loras} adapters are resident (ROLLOUT_MAX_LORAS); unload one "
                                        "first", errors={"limit": self.max_loras})
            slot = free[0]
        if adapter.rank > self._rank:
            self._grow(adapter.rank)
        for name in adapter.modules:
            if name not in self._a:
                self._add_module(name)
        for name in self._a:
            self._a[name][slot].zero_()
            self._b[name][slot].zero_()
        for name, (a, b) in adapter.modules.items():
            self._a[name][slot, :adapter.rank] = a.to(self.device)
            self._b[name][slot, :adapter.rank] = b.t().to(self.device)
        self._scale[slot] = adapter.scale
        self._slot[adapter_id], self._adapters[adapter_id] = slot, adapter
        self._live.add(adapter_id)
        if adapter_id in self._retired:
            self._retired.remove(adapter_id)

    def retire(self, adapter_id: str) -> bool:
        """New requests may no longer name ``adapter_id``; it stays resident for the rows running
        under it until its slot is needed (then the one retired longest ago goes). False when it was
        not served."""
        if adapter_id not in self._live:
            return False
        self._live.discard(adapter_id)
        self._retired.append(adapter_id)
        return True

    def remove(self, adapter_id: str) -> bool:
        """Free ``adapter_id``'s slot; False when it was not resident."""
        slot = self._slot.pop(adapter_id, None)
        if slot is None:
            return False
        del self._adapters[adapter_id]
        self._live.discard(adapter_id)
        if adapter_id in self._retired:
            self._retired.remove(adapter_id)
        for name in self._a:
            self._a[name][slot].zero_()
            self._b[name][slot].zero_()
        self._scale[slot] = 0.0
        return True

    @contextmanager
    def rows(self, adapter_ids: Sequence[str]) -> Iterator[None]:
        """Forwards inside run row ``i`` under ``adapter_ids[i]`` ("" is the base)."""
        previous = getattr(self._local, "selection", None)
        self._local.selection = self._select(adapter_ids)
        try:
            yield
        finally:
            self._local.selection = previous

    def _select(self, adapter_ids: Sequence[str]) -> _Selection | None:
        missing = sorted({a for a in adapter_ids if a and a not in self._slot})
        if missing:
            raise AdapterNotFoundError(f"adapter {missing[0]!r} is not loaded", errors={"adapter": missing[0]})
        used = sorted({self._slot[a] for a in adapter_ids if a})
        if not used:
            return None
        rank, column = self._rank, {slot: i for i, slot in enumerate(used)}
        mask = torch.zeros(len(adapter_ids), len(used) * rank)
        for row, adapter_id in enumerate(adapter_ids):
            if adapter_id:
                slot = self._slot[adapter_id]
                start = column[slot] * rank
                mask[row, start:start + rank] = self._scale[slot]
        return _Selection(torch.tensor(used, device=self.device), mask.to(self.device), len(adapter_ids))

    def _hook(self, name: str, module, args, output):
        selection = getattr(self._local, "selection", None)
        if selection is None:
            return None
        x = args[0]
        if x.dim() != 3 or x.shape[0] != selection.rows:
            raise RuntimeError(f"{name}: input {tuple(x.shape)} is not (rows={selection.rows}, tokens, features)")
        a = self._a[name].index_select(0, selection.used).flatten(0, 1)  # (U*R, in)
        b = self._b[name].index_select(0, selection.used).flatten(0, 1)  # (U*R, out)
        h = torch.matmul(x.to(a.dtype), a.t()) * selection.mask[:, None, :]
        return (output.to(a.dtype) + torch.matmul(h, b)).to(output.dtype)

    def _add_module(self, name: str) -> None:
        linear = self._targets[name]
        self._a[name] = torch.zeros(self.max_loras, self._rank, linear.in_features, device=self.device)
        self._b[name] = torch.zeros(self.max_loras, self._rank, linear.out_features, device=self.device)
        self._hooks[name] = linear.register_forward_hook(lambda mod, args, out, _n=name: self._hook(_n, mod, args, out))

    def _grow(self, rank: int) -> None:
        """Every stack padded to ``rank`` columns (zeros: they add nothing)."""
        for stacks in (self._a, self._b):
            for name, stack in stacks.items():
                grown = torch.zeros(stack.shape[0], rank, stack.shape[2], device=self.device)
                grown[:, :self._rank] = stack
                stacks[name] = grown
        self._rank = rank


def check_adapter(facts, request) -> None:
    """Refuse a request naming an adapter the model does not hold: never the base's answer."""
    adapter = getattr(request, "adapter", "")
    if adapter and not (getattr(facts, "adapters", None) is not None and adapter in facts.adapters):
        raise AdapterNotFoundError(f"adapter {adapter!r} is not loaded", errors={"adapter": adapter})


def lora_rows(loaded, adapter_ids: Sequence[str]):
    """The context in which ``loaded``'s forwards run row ``i`` under ``adapter_ids[i]``."""
    if not any(adapter_ids):
        return nullcontext()
    bank = getattr(loaded, "adapters", None)
    if bank is None:
        missing = next(a for a in adapter_ids if a)
        raise AdapterNotFoundError(f"adapter {missing!r} is not loaded", errors={"adapter": missing})
    return bank.rows(adapter_ids)
