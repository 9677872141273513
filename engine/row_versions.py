"""Which weights produced each of a row's tokens, for a row that may live through weight swaps
(update mode ``keep``: engine/weight_crossing.py).

A token's version is the one whose forward gave the logits it was drawn from. A row records a
mark where its version changes; :meth:`RowVersions.spans` turns the marks into SGLang's
``weight_versions``: ``[{version, start, end}]``, half-open over the output tokens."""

from __future__ import annotations


class RowVersions:
    def __init__(self, version: str):
        self._marks: list[tuple[int, str]] = [(0, version)]  # (first output token, version)
        self.crossed = 0  # swaps this row lived through holding KV
        self.recomputed = 0  # of those, the ones after which its KV was computed again

    @property
    def current(self) -> str:
        return self._marks[-1][1]

    def mark(self, tokens: int, version: str) -> None:
        """From output token ``tokens`` on, ``version`` makes them (a row with no token yet since
        its last mark just changes version)."""
        if self._marks[-1][0] == tokens:
            self._marks[-1] = (tokens, version)
        elif self._marks[-1][1] != version:
            self._marks.append((tokens, version))

    def spans(self, tokens: int) -> list[dict]:
        """``[{version, start, end}]`` over ``tokens`` output tokens; empty spans left out (a
        row whose tokens all came from one version has one span)."""
        ends = [start for start, _ in self._marks[1:]] + [tokens]
        return [{"version": version, "start": start, "end": min(end, tokens)}
                for (start, version), end in zip(self._marks, ends, strict=True) if min(end, tokens) > start]

    def kv_recomputed(self) -> bool | None:
        """None for a row that crossed no swap; else whether its earlier tokens' KV was computed
        again by the new weights at every swap it crossed (``recompute_kv``)."""
        return None if not self.crossed else self.recomputed == self.crossed
