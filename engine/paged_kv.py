"""Paged KV memory: the running batch's keys and values in fixed-size blocks of one pool, a block
table per row.

A row holds the blocks its own length needs; a finished row's blocks go back at once; rows join
and leave by editing tables, nothing is copied; a decode step writes only each row's new K/V.
Blocks are reference-counted, so the ``n`` samples of a prompt, and later requests that find its
blocks cached by name, hold the prompt's blocks once; a row copies a shared or named block only
when it writes into it (the prompt's last, partial block: copy-on-write).

Why by hand, when transformers ships ``PagedAttentionCache`` for its continuous batching:

- its allocator is driven by its own scheduler's ``RequestState`` and ``ContinuousBatchingConfig``,
  which take token ids only (the reason :mod:`engine.scheduler` is ours: docs/architecture.md);
- its sdpa and eager path packs every request's tokens into one row and attends each query to the
  whole packed cache under a (1, 1, queries, keys) mask, so a decode step of R rows costs R times
  the attention of a batched one; its block-table kernels need CUDA flash-attention;
- its prefix sharing matches token ids, and a multimodal prompt's placeholder ids are the same
  whatever its images: two prompts with different pictures would share blocks.

What this module uses of transformers: the model's own attention, unchanged. Every decoder layer
hands its new K/V to ``cache.update(...)`` and attends to what it returns; a 4-D mask passes the
model's mask building as is (``masking_utils``). :class:`PagedStep` is that cache for one forward.

Layout: per layer, keys and values of shape (kv heads, blocks + 1, block size, head dim), so the
gather of the rows' blocks is already (rows, heads, tokens, dim) as a view, the layout attention
takes. Block 0 is never handed out: it pads the shorter rows' tables, and the mask hides it.
Without a fused paged-attention kernel (none runs on CPU), a forward reads the rows' blocks with
one gather per layer, as wide as the longest row; that tensor lives for one layer's attention.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from engine.errors import KVPoolExhausted

NULL_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """What one token's K and V take over every layer of the model of ``config``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_tokens_for_memory(config, dtype: torch.dtype, free_bytes: int, fraction: float) -> int:
    """The KV pool, in tokens, that ``fraction`` of ``free_bytes`` of device memory holds."""
    return int(free_bytes * fraction) // kv_bytes_per_token(config, dtype)


class BlockPool:
    """``capacity`` blocks of ``block_size`` tokens of K/V for every layer, allocated once (at the
    first write, from the shapes of the model's own K/V) and handed out by reference count.

    A block may carry a name (:mod:`engine.prefix_hash`): the hash of its tokens chained to its
    prefix's. A named block that no row holds stays free *and* cached: a request that finds its
    name takes it back (:meth:`share`) instead of computing it. Free blocks go out unnamed ones
    first, then named ones least recently used first, so the cache is what the pool does not need;
    a named block is never written again (rows copy it first: :mod:`engine.running_batch`). This is
    vLLM's block pool's scheme (``vllm/v1/core/block_pool.py``: a free queue that evicts cached
    blocks LRU, a hash-to-block map, ``touch`` on a hit).
    """

    def __init__(self, capacity: int, block_size: int):
        if capacity < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one token")
        self.capacity, self.block_size = capacity, block_size
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # Free blocks in the order they go out (an OrderedDict as a queue with removal from the
        # middle, which a hit does): unnamed ones at the front, named ones behind, oldest first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, capacity + 1))
        self._refs = [0] * (capacity + 1)
        self._name_of: dict[int, bytes] = {}
        self._by_name: dict[bytes, int] = {}
        self._workspaces: list[torch.Tensor | None] = [None, None]  # a forward's gathered keys, values

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def free(self) -> int:
        """Blocks no row holds, cached ones included (they are given out when needed)."""
        return len(self._free)

    @property
    def cached(self) -> int:
        """Named blocks, held or free."""
        return len(self._by_name)

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks, zeroed, one reference each; the least recently used cached blocks lose
        their names when there are not enough unnamed ones."""
        if count > len(self._free):
            raise KVPoolExhausted(f"{count} KV blocks wanted, {len(self._free)} of {self.capacity} free",
                                  errors={"kv_blocks_free": len(self._free), "kv_blocks": self.capacity})
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
            if (name := self._name_of.pop(block, None)) is not None:
                del self._by_name[name]
        self._clear(blocks)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each of ``blocks``; a cached free block leaves the free queue."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less to each of ``blocks`` (a row's, in token order). They are freed last
        block first, so a prompt's deepest cached blocks are evicted before the ones it starts
        with, which more requests share (vLLM frees a request's blocks in reverse too)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if block not in self._name_of:  # nothing to keep: it goes out first
                    self._free.move_to_end(block, last=False)

    def cached_run(self, names: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of ``names``, from the first, that the pool holds (no
        reference taken: :meth:`share` them before anything else allocates)."""
        blocks = []
        for name in names:
            block = self._by_name.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def name(self, block: int, name: bytes) -> None:
        """Make ``block`` findable as ``name`` (its K/V is complete and final). A name already in
        the pool keeps its block; a block keeps its first name."""
        if name in self._by_name or block in self._name_of or block == NULL_BLOCK:
            return
        self._by_name[name] = block
        self._name_of[block] = name

    def is_named(self, block: int) -> bool:
        return block in self._name_of

    def forget(self, block: int) -> None:
        """``block`` is not found by its name again (its holder is about to write into it)."""
        if (name := self._name_of.pop(block, None)) is not None:
            del self._by_name[name]

    def forget_names(self) -> None:
        """No block is found again (the weights changed: what they computed is stale). Free named
        blocks go to the front of the queue."""
        for block in self._name_of:
            if self._refs[block] == 0:
                self._free.move_to_end(block, last=False)
        self._name_of.clear()
        self._by_name.clear()

    def is_shared(self, block: int) -> bool:
        return self._refs[block] > 1

    def write_prompt(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        """Blocks holding one prompt's K/V, given per layer as (heads, length, dim) tensors."""
        length = layers[0][0].shape[1]
        if not self.keys:
            self._materialize(layers)
        blocks = self.allocate(blocks_for(length, self.block_size))
        slots = self.slots(blocks, 0, length, device=self.keys[0].device)
        for index, (keys, values) in enumerate(layers):
            flat_slots(self.keys[index]).index_copy_(1, slots, keys.to(self.keys[index].dtype))
            flat_slots(self.values[index]).index_copy_(1, slots, values.to(self.values[index].dtype))
        return blocks

    def _clear(self, blocks: Sequence[int]) -> None:
        """Zero ``blocks`` in every layer. A decode step gathers each row's last block whole and
        attention computes a score for every gathered slot before the mask drops it, so a NaN or
        infinity left in an unwritten slot by a block's last holder (an fp16 overflow, absurd
        media features) would turn another row's attention into NaN (0 x NaN is NaN). Handing
        blocks out clean keeps one row's values out of every other row's; a prompt's own blocks
        are written over right after."""
        if not self.keys or not blocks:
            return
        index = torch.tensor(blocks, dtype=torch.long, device=self.keys[0].device)
        for layer in (*self.keys, *self.values):
            layer.index_fill_(1, index, 0)

    def copy_block(self, source: int, target: int) -> None:
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[:, target] = layer[:, source]

    def slots(self, blocks: Sequence[int], start: int, stop: int, *, device) -> torch.Tensor:
        """Flat slot indices of token positions ``start..stop`` of a row holding ``blocks``."""
        positions = torch.arange(start, stop)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[positions // self.block_size] * self.block_size + positions % self.block_size).to(device)

    def workspace(self, which: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``shape`` for gathered keys (0) or values (1), reused by every layer of every
        forward: a layer's attention is done with it before the next layer gathers."""
        need = 1
        for size in shape:
            need *= size
        buffer = self._workspaces[which]
        if buffer is None or buffer.numel() < need:
            buffer = self._workspaces[which] = like.new_empty(max(need, 2 * (0 if buffer is None else buffer.numel())))
        return buffer[:need].view(shape)

    def _materialize(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        shape = (self.capacity + 1, self.block_size)
        for keys, values in layers:
            # torch.zeros: untouched pages of a large pool are not resident until written (calloc).
            self.keys.append(keys.new_zeros((keys.shape[0], *shape, keys.shape[2])))
            self.values.append(values.new_zeros((values.shape[0], *shape, values.shape[2])))


def flat_slots(layer: torch.Tensor) -> torch.Tensor:
    """A layer's pool as (heads, slots, dim): slot = block x block size + offset."""
    return layer.view(layer.shape[0], -1, layer.shape[3])


@dataclass
class PagedPrompt:
    """A prefilled prompt's K/V in the pool: its blocks (one reference held by this object until
    :meth:`release`) and its length."""

    pool: BlockPool
    blocks: list[int]
    length: int

    def release(self) -> None:
        self.pool.release(self.blocks)
        self.blocks = []


def write_prompts(pool: BlockPool, cache, lengths: Sequence[int],
                  prefixes: Sequence[Sequence[int]] | None = None) -> list[PagedPrompt]:
    """Each row of a prefill ``cache`` (transformers' ``DynamicCache``) in blocks of ``pool``: row
    ``i`` holds ``lengths[i]`` tokens, the first of them already in the blocks ``prefixes[i]``
    (whole blocks found cached, taken by the caller: the prompt takes over that reference), the
    rest the last columns of its cache row (rows are right-aligned: left padding, or a padded
    prefix before them). All or none: blocks taken are given back on failure."""
    layers = list(cache.layers)
    for layer in layers:
        if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
            raise NotImplementedError(f"cache layer {type(layer).__name__} cannot be paged")
    prefixes = prefixes or [[] for _ in lengths]
    written: list[PagedPrompt] = []
    try:
        for row, (length, prefix) in enumerate(zip(lengths, prefixes, strict=True)):
            new = int(length) - len(prefix) * pool.block_size
            blocks = pool.write_prompt([(layer.keys[row, :, -new:], layer.values[row, :, -new:]) for layer in layers])
            written.append(PagedPrompt(pool, [*prefix, *blocks], int(length)))
    except BaseException:
        for prompt in written:
            prompt.release()
        for prefix in prefixes[len(written):]:
            pool.release(prefix)
        raise
    return written


def prefix_cache(pool: BlockPool, prefixes: Sequence[Sequence[int]], *, dtype: torch.dtype):
    """A ``DynamicCache`` holding each row's cached prefix blocks, rows left-padded with the null
    block (zeros) to the longest: what a prefill of the rest of each prompt attends to, its
    attention mask hiding the padding. One gather per layer, as a decode step's."""
    width = max(map(len, prefixes))
    table = torch.tensor([[NULL_BLOCK] * (width - len(p)) + list(p) for p in prefixes], dtype=torch.long,
                         device=pool.keys[0].device).flatten()
    cache = DynamicCache()
    for index, (keys, values) in enumerate(zip(pool.keys, pool.values, strict=True)):
        heads, _, size, dim = keys.shape
        gathered = [layer.index_select(1, table).view(heads, len(prefixes), width * size, dim)
                    .transpose(0, 1).to(dtype) for layer in (keys, values)]
        cache.update(gathered[0], gathered[1], index)
    return cache


class PagedStep:
    """The ``cache`` of one decode forward over rows holding ``tables``: each layer's
    :meth:`update` writes the rows' new K/V at ``write_slots`` and returns every row's first
    ``width`` tokens of K/V gathered from its blocks, (rows, heads, width, dim), a row's slots
    past its own length read from its last block or the null block (the mask hides them)."""

    def __init__(self, pool: BlockPool, tables: torch.Tensor, write_slots: torch.Tensor, width: int):
        self.pool, self.tables, self.write_slots, self.width = pool, tables, write_slots, width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        out = []
        rows, table_width = self.tables.shape
        blocks = self.tables.flatten()
        for which, layer, states in ((0, self.pool.keys[layer_idx], key_states),
                                     (1, self.pool.values[layer_idx], value_states)):
            flat_slots(layer).index_copy_(1, self.write_slots, states[:, :, -1].transpose(0, 1).to(layer.dtype))
            heads, _, size, dim = layer.shape
            # index_select of whole blocks into a reused buffer: a copy at memory speed (advanced
            # indexing is 3x slower here, and a fresh buffer per layer pays its page faults).
            gathered = self.pool.workspace(which, (heads, rows * table_width, size * dim), layer)
            torch.index_select(layer.view(heads, -1, size * dim), 1, blocks, out=gathered)
            view = gathered.view(heads, rows, table_width * size, dim).permute(1, 0, 2, 3)  # (rows, heads, tokens, dim)
            out.append(view[:, :, :self.width].to(states.dtype))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


def decode_mask(lengths: torch.Tensor, width: int, *, attn_implementation: str | None,
                dtype: torch.dtype) -> torch.Tensor:
    """The 4-D mask of a decode step whose rows hold ``lengths`` tokens before it (a tensor on the
    model's device): each row's query sees its first ``length + 1`` slots (its cache and its new
    token), of ``width`` (the longest row's + 1). Always given, even when all rows see every slot:
    a 4-D mask passes the model's mask building as is, which then never asks this cache for sizes.
    Boolean for sdpa (what its own mask building gives), additive for the others (eager)."""
    seen = torch.arange(width, device=lengths.device)[None, :] <= lengths[:, None]
    mask = seen[:, None, None, :]
    if attn_implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=lengths.device).masked_fill_(~mask, torch.finfo(dtype).min)
