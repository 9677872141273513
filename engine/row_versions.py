"""Which weights produced each of a row's tokens, for a row that may live through weight swaps
(update mode ``keep``: engine/weight_crossing.py) and through in-place updates of its LoRA adapter.

A token's version is the one whose forward gave the logits it was drawn from: the base's weight
version and, for a LoRA row, the adapter's id (its name and version). A row records a mark where
either changes; :meth:`RowVersions.spans` turns the marks into SGLang's ``weight_versions``:
``[{version, start, end}]``, half-open over the output tokens, each span of a LoRA row naming its
``adapter`` too."""

from __future__ import annotations


class RowVersions:
    def __init__(self, version: str, adapter: str = ""):
        # (first output token, base version, adapter id; "" is the base alone)
        self._marks: list[tuple[int, str, str]] = [(0, version, adapter)]
        self.crossed = 0  # swaps this row lived through holding KV
        self.recomputed = 0  # of those, the ones after which its KV was computed again

    @property
    def current(self) -> str:
        return self._marks[-1][1]

    @property
    def adapter(self) -> str:
        return self._marks[-1][2]

    def mark(self, tokens: int, version: str | None = None, *, adapter: str | None = None) -> None:
        """From output token ``tokens`` on, ``version`` (the base's, unchanged when None) under
        ``adapter`` (unchanged when None) makes them; a row with no token yet since its last mark
        just changes them."""
        mark = (tokens, self.current if version is None else version, self.adapter if adapter is None else adapter)
        if self._marks[-1][0] == tokens:
            self._marks[-1] = mark
        elif self._marks[-1][1:] != mark[1:]:
            self._marks.append(mark)

    def spans(self, tokens: int) -> list[dict]:
        """``[{version, start, end}]`` (and ``adapter`` for a LoRA row) over ``tokens`` output
        tokens; empty spans left out (a row whose tokens all came from one version has one span)."""
        ends = [start for start, _, _ in self._marks[1:]] + [tokens]
        spans = []
        for (start, version, adapter), end in zip(self._marks, ends, strict=True):
            if min(end, tokens) > start:
                span = {"version": version, "start": start, "end": min(end, tokens)}
                spans.append({**span, "adapter": adapter} if adapter else span)
        return spans

    def kv_recomputed(self) -> bool | None:
        """None for a row that crossed no swap; else whether its earlier tokens' KV was computed
        again by the new weights at every swap it crossed (``recompute_kv``)."""
        return None if not self.crossed else self.recomputed == self.crossed
