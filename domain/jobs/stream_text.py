"""The text deltas a streamed row sends, so that they add up to exactly the result's text.

Two things make a naive "decode each new token" wrong: a UTF-8 character split across byte
tokens (handled by :class:`engine.detokenize.IncrementalText`, which commits whole characters
only), and stop strings, which cut the result's text where the match starts, possibly inside text
already decoded. So the last ``len(longest stop) - 1`` committed characters are held back while the
row runs (vLLM's and SGLang's streamers do the same), and the row's final delta is taken from
the result's own text: what was sent is always a prefix of it (the held-back window covers any
stop string that starts before the end of what was sent).
"""

from __future__ import annotations

import logging

from engine.detokenize import IncrementalText

log = logging.getLogger(__name__)


class StreamText:
    def __init__(self, tokenizer, params):
        self._text = IncrementalText(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                     spaces_between_special_tokens=params.spaces_between_special_tokens)
        self._hold = max((len(stop) for stop in params.stop), default=1) - 1
        self.sent = ""
        self.finished = False

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` lets the stream send now (often "")."""
        self._text.push(token_id)
        committed = self._text.text
        visible = committed[: len(committed) - self._hold] if self._hold else committed
        if len(visible) <= len(self.sent):
            return ""
        delta, self.sent = visible[len(self.sent):], visible
        return delta

    def finish(self, final_text: str | None) -> str:
        """The last delta: the rest of the result's text."""
        self.finished = True
        final_text = final_text or ""
        if not final_text.startswith(self.sent):
            # Cannot happen by the argument above; if it ever does, the stream cannot take text back.
            log.error("streamed text is not a prefix of the result's text; the stream's text is short")
            return ""
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta
