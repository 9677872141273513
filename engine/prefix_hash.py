"""The names of KV blocks: what lets a request find blocks another request computed.

A full block of ``block_size`` tokens is named by a hash chained to its prefix's name: its token
ids, the content keys of the media whose placeholders it holds, and its parent block's hash. The
chain starts from a root that holds the caller's cache scope (the API key, and a dialect's
``cache_salt``) and the weight version, so two keys, two salts or two weight versions never name
a block alike. This is vLLM's automatic prefix caching's scheme (``vllm/v1/core/kv_cache_utils.py``:
``hash_block_tokens`` chained over full blocks, media hashes as a block's extra keys, the salt in
the first block).

A prompt's last, partial block gets a name too (:attr:`PromptHashes.tail`), found only by a prompt
that ends exactly there: the whole-prompt hit of a prompt group whose samples arrive apart.

Why blake2b, not Python's ``hash``: a tuple hash is cheap to collide on purpose, and a collision
here would hand one key's K/V to another (vLLM moved to sha256 for that reason). A 16-byte digest
of one buffer per block costs about 2 µs here (bench/prefix_reuse.py).

Torch-free, so it is tested alone and the API could name a prompt's blocks the way the engine does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MediaSpan:
    """A media item's placeholders ``[start, stop)`` in the prompt, and its content key."""

    start: int
    stop: int
    key: str


@dataclass(frozen=True)
class PromptHashes:
    """A prompt's block names: one per full block (``full``), and its partial last block's
    (``tail``; None when the prompt ends on a block boundary). ``last`` names the whole prompt."""

    root: bytes
    full: tuple[bytes, ...]
    tail: bytes | None

    @property
    def last(self) -> bytes:
        if self.tail is not None:
            return self.tail
        return self.full[-1] if self.full else self.root


def root_hash(scope: str, weight_version: str) -> bytes:
    """Where a chain starts: nothing of another scope or other weights ever shares it."""
    return _digest(b"root", scope.encode(), weight_version.encode())


def chain(parent: bytes, token_ids: Sequence[int], block_size: int, media: Sequence[MediaSpan], *,
          first_block: int = 0, full_only: bool = True) -> list[bytes]:
    """Names of the blocks of ``token_ids`` (a sequence from position 0) starting at block
    ``first_block``, whose parent is ``parent``: every full block, and the partial last one unless
    ``full_only``. A block's name hashes, in one call, its parent (16 bytes), its token count, its
    token ids and its media keys, each key after its length: no two blocks read alike."""
    tokens = array("q", token_ids).tobytes()
    names = []
    end = len(token_ids) if not full_only else len(token_ids) // block_size * block_size
    for start in range(first_block * block_size, end, block_size):
        stop = min(start + block_size, end)
        data = parent + (stop - start).to_bytes(4, "little") + tokens[8 * start: 8 * stop]
        for item in media:
            if item.start < stop and start < item.stop:
                key = item.key.encode()
                data += len(key).to_bytes(4, "little") + key
        parent = hashlib.blake2b(data, digest_size=16).digest()
        names.append(parent)
    return names


def prompt_hashes(scope: str, weight_version: str, token_ids: Sequence[int], block_size: int,
                  media: Sequence[MediaSpan]) -> PromptHashes:
    root = root_hash(scope, weight_version)
    names = chain(root, token_ids, block_size, media, full_only=False)
    if len(token_ids) % block_size:
        return PromptHashes(root, tuple(names[:-1]), names[-1])
    return PromptHashes(root, tuple(names), None)


def _digest(*parts: bytes) -> bytes:
    """One hash of ``parts``, each after its length: no two lists of parts read alike."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()
