"""Text of generated tokens: whole-sequence decoding, incremental decoding, stop strings.

Byte-level BPE splits a UTF-8 character across tokens (``"猫"`` is three byte tokens in the
demo tokenizer), so decoding token by token would show U+FFFD halves. :class:`IncrementalText`
keeps the window of tokens whose text is not yet final and only commits text once the window no
longer ends in a partial character (the prefix/read offsets that vLLM's slow path, SGLang's
detokenizer manager and transformers' ``TextStreamer`` use). It is written here rather than
taken from ``tokenizers.decoders.DecodeStream`` because it must decode through
:func:`decode_text`, which honours ``spaces_between_special_tokens=False`` (DecodeStream knows
only ``skip_special_tokens``), and it works with any transformers tokenizer, fast or slow.

The committed text always equals :func:`decode_text` of the tokens committed so far (tests check
it on multi-byte output); :meth:`IncrementalText.finish` adds the still-open tail as the whole
decode would (a character cut by ``max_tokens`` shows as U+FFFD, as ``tokenizer.decode`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
# A window of open tokens past this long commits what has settled (IncrementalText._commit_settled).
OPEN_TOKENS = 8
_LONGEST_CHARACTER = 4  # bytes in UTF-8, so tokens of a byte-level BPE


def decode_text(tokenizer: Any, token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True) -> str:
    """The text of ``token_ids``.

    ``spaces_between_special_tokens=True`` (everyone's default) is the tokenizer's own decoding.
    ``False`` decodes the runs between added tokens separately and joins them with nothing, so
    no decoder (WordPiece, Metaspace) can put a space next to an added token: the semantics of
    transformers' slow tokenizers, which its fast tokenizers do not implement.
    """
    ids = list(token_ids)
    if spaces_between_special_tokens:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    added = tokenizer.added_tokens_decoder  # id -> AddedToken (special or not)
    pieces: list[str] = []
    run: list[int] = []
    for token in ids:
        if token not in added:
            run.append(token)
            continue
        if skip_special_tokens and added[token].special:
            continue
        if run:
            pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
            run = []
        pieces.append(added[token].content)
    if run:
        pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
    return "".join(pieces)


class IncrementalText:
    """The text of a growing token sequence, committed only at whole characters."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._options = {"skip_special_tokens": skip_special_tokens,
                         "spaces_between_special_tokens": spaces_between_special_tokens}
        self.token_ids: list[int] = []
        self.text = ""
        # token_ids[prefix:read] is committed context (decoded again so that decoders which
        # depend on the previous token, such as a leading space, see it); token_ids[read:] is open.
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return decode_text(self._tokenizer, ids, **self._options)

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it committed ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        before = self._decode(self.token_ids[self._prefix:self._read])
        after = self._decode(self.token_ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            return self._commit(after[len(before):], len(self.token_ids))
        if len(self.token_ids) - self._read > OPEN_TOKENS:
            return self._commit_settled(before, after)
        return ""

    def _commit(self, new: str, read: int) -> str:
        self._prefix, self._read = self._read, read
        self.text += new
        return new

    def _commit_settled(self, before: str, after: str) -> str:
        """Text that ends in U+FFFD for good (bytes that never make a character: a model sampling
        stray byte tokens) would keep the window open and decode it whole at every step, a cost
        that grows with the square of the output. A character is at most 4 bytes, so one begun
        more than 4 tokens back has ended, whole or broken: the window up to there is committed,
        once its text is where the whole window's text starts (no character across the cut)."""
        cut = len(self.token_ids) - _LONGEST_CHARACTER
        settled = self._decode(self.token_ids[self._prefix:cut])
        if len(settled) <= len(before) or not after.startswith(settled) or len(after) == len(settled):
            return ""
        return self._commit(settled[len(before):], cut)

    def finish(self) -> str:
        """The whole text, the open tail included."""
        before = self._decode(self.token_ids[self._prefix:self._read])
        after = self._decode(self.token_ids[self._prefix:])
        return self.text + after[len(before):]


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """``(index, stop)`` of the earliest stop string that ends in the last ``new_chars`` of
    ``text``; earlier text was searched before (the window reaches back a stop's length - 1)."""
    if new_chars <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
