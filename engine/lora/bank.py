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
from collections.abc import Callable, Iterator, Sequence
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
    """Adapters by id (the service's name and version): every loaded one kept on the CPU (at most
    ``max_cpu_loras``, vLLM's ``max_cpu_loras``), at most ``max_loras`` of them resident in the
    device's slots, brought in when a forward names them, least recently used out (vLLM's and
    S-LoRA's tiers). The scheduler admits no job whose adapter would make the running jobs'
    adapters more than the slots (:func:`adapter_admissible`), so a forward's adapters always fit.
    ``add``, ``retire`` and ``remove`` run between forwards (under the model's lock)."""

    def __init__(self, model, *, max_loras: int, max_rank: int, max_cpu_loras: int | None = None,
                 in_use: Callable[[], set[str]] | None = None):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.in_use = in_use or set  # the adapters of the requests the engine's schedulers hold
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.device = next(model.parameters()).device
        self._targets = adaptable_modules(model)
        self._adapters: dict[str, LoraAdapter] = {}  # every known adapter, on the CPU
        self._live: set[str] = set()  # those new requests may name
        self._retired: list[str] = []  # kept for the rows still running under them, oldest first
        self._slot: dict[str, int] = {}  # the resident ones' slots
        self._used: dict[str, int] = {}  # the forward that last named each resident one
        self._forwards = 0
        self.swaps_in = 0  # adapters copied into a slot (a load that found one free, or a forward)
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

    def resident(self) -> list[str]:
        return sorted(self._slot)

    def add(self, adapter_id: str, adapter: LoraAdapter) -> None:
        """Keep ``adapter`` as ``adapter_id`` (replacing one of that id), resident now if a slot is free."""
        if adapter_id not in self._live and len(self._live) >= self.max_cpu_loras:
            raise AdapterLimitError(f"{self.max_cpu_loras} adapters are loaded (ROLLOUT_MAX_CPU_LORAS); unload one "
                                    "first", errors={"limit": self.max_cpu_loras})
        self._adapters[adapter_id] = adapter
        self._live.add(adapter_id)
        if adapter_id in self._retired:
            self._retired.remove(adapter_id)
        self._drop_retired()
        if adapter_id in self._slot:
            self._write(self._slot[adapter_id], adapter)
        elif free := self._free_slots():
            self._bring_in(adapter_id, free[0])

    def retire(self, adapter_id: str) -> bool:
        """New requests may no longer name ``adapter_id``; it is kept while a request holds it.
        False when it was not served."""
        if adapter_id not in self._live:
            return False
        self._live.discard(adapter_id)
        self._retired.append(adapter_id)
        self._drop_retired()
        return True

    def _drop_retired(self) -> None:
        """Retired adapters no request holds are dropped from both tiers."""
        if self._retired:
            held = self.in_use()
            for adapter_id in [a for a in self._retired if a not in held]:
                self.remove(adapter_id)

    def remove(self, adapter_id: str) -> bool:
        """Drop ``adapter_id`` from both tiers; False when it was not kept."""
        if self._adapters.pop(adapter_id, None) is None:
            return False
        self._live.discard(adapter_id)
        if adapter_id in self._retired:
            self._retired.remove(adapter_id)
        self._evict(adapter_id)
        return True

    def _free_slots(self) -> list[int]:
        return sorted(set(range(self.max_loras)) - set(self._slot.values()))

    def _evict(self, adapter_id: str) -> int | None:
        slot = self._slot.pop(adapter_id, None)
        self._used.pop(adapter_id, None)
        if slot is not None:
            with torch.inference_mode(False), torch.no_grad():
                for name in self._a:
                    self._a[name][slot].zero_()
                    self._b[name][slot].zero_()
            self._scale[slot] = 0.0
        return slot

    def _ensure_resident(self, adapter_ids: set[str]) -> None:
        """Every one of ``adapter_ids`` in a slot: free ones first, then the least recently used
        resident adapter this forward does not name gives its slot up (it stays on the CPU)."""
        if len(adapter_ids) > self.max_loras:
            raise AdapterLimitError(f"a forward names {len(adapter_ids)} adapters, more than the "
                                    f"{self.max_loras} slots (ROLLOUT_MAX_LORAS)", errors={"limit": self.max_loras})
        for adapter_id in sorted(adapter_ids - set(self._slot)):
            free = self._free_slots()
            if free:
                slot = free[0]
            else:
                self._drop_retired()  # a slot a retired adapter no one holds any more kept
                free = self._free_slots()
            if free:
                slot = free[0]
            else:
                victim = min((a for a in self._slot if a not in adapter_ids), key=lambda a: self._used.get(a, -1))
                slot = self._evict(victim)
            self._bring_in(adapter_id, slot)

    def _bring_in(self, adapter_id: str, slot: int) -> None:
        self._write(slot, self._adapters[adapter_id])
        self._slot[adapter_id] = slot
        self._used[adapter_id] = self._forwards
        self.swaps_in += 1

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        # Not inference tensors even when a forward brings an adapter in: a later add writes them.
        with torch.inference_mode(False), torch.no_grad():
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
        named = {a for a in adapter_ids if a}
        missing = sorted(a for a in named if a not in self._adapters)
        if missing:
            raise AdapterNotFoundError(f"adapter {missing[0]!r} is not loaded", errors={"adapter": missing[0]})
        if not named:
            return None
        self._forwards += 1
        self._ensure_resident(named)
        for adapter_id in named:
            self._used[adapter_id] = self._forwards
        used = sorted({self._slot[a] for a in named})
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


def adapter_admissible(pending: Sequence, active: Sequence, facts) -> Sequence:
    """The pending jobs admission may take without the active jobs' adapters outgrowing the
    device's slots. While a slot is left, all. Once they are full and a job waits for a new
    adapter, only the base's: the active adapters' rows drain until one frees its slot, so a key
    whose adapter is not on the device is not starved by keys that keep theirs busy (admission
    then picks by each key's recent use, engine/capacity.py)."""
    bank = getattr(facts, "adapters", None)
    if bank is None or all(not job.adapter for job in pending):
        return pending
    in_use = {job.adapter for job in active if job.adapter}
    if len(in_use) < bank.max_loras:
        return pending
    if any(job.adapter and job.adapter not in in_use for job in pending):
        return [job for job in pending if not job.adapter]
    return pending
