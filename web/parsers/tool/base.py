"""A tool-call format where a marker opens a block of JSON calls, parsed from text that may still
be growing.

``parse(text, final=False)`` is a pure function of the text so far, and every part of what it
returns only grows as the text does (content, each call's name once whole, each call's arguments),
so a stream is its successive parses' differences (``ToolCallStream``) and adds up to the whole
text's parse by construction. Text that may yet turn into markup (a marker's first characters at
the end) is held back until the next text or ``final`` decides it.

Matched against vLLM's ``hermes`` and ``mistral`` parsers
(``vllm/entrypoints/openai/tool_parsers/``): the same markup, the same calls. Where vLLM differs:
arguments are the model's own text of the JSON value (vLLM re-serializes them with ``json.dumps``,
so its stream and its reply could disagree); text between or after calls is content (vLLM's reply
keeps only the text before the first call, its stream all of it); whitespace around calls is not
content (a call-only turn has ``content: null``); a block whose JSON names no function stays content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from web.parsers.json_scan import ObjectScan, scan_array, scan_object


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the JSON text so far; whole once ``complete``
    complete: bool


@dataclass(frozen=True)
class ToolParse:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class MarkerToolParser:
    """``start`` opens a block; ``end`` closes it (None: the block's JSON closes it). The block
    holds one call object, or with ``array`` a JSON array of them."""

    name = ""
    start = ""
    end: str | None = None
    array = False

    def parse(self, text: str, *, final: bool = True) -> ToolParse:
        content: list[str] = []
        calls: list[ParsedCall] = []
        at = 0
        while True:
            opened = text.find(self.start, at)
            if opened < 0:
                tail = text[at:]
                content.append(tail if final else tail[:len(tail) - held_prefix(tail, self.start)])
                break
            content.append(text[at:opened])
            body = opened + len(self.start)
            found, closed_at = self._block(text, body, final)
            if found is None:  # no call in it: the block is text
                if closed_at is None:
                    if final:
                        content.append(text[opened:])
                    break
                content.append(text[opened:closed_at])
            else:
                calls.extend(found)
                if closed_at is None:
                    break
            at = closed_at
        joined = "".join(content)
        if calls or not final:  # whitespace around calls is layout; a stream waits to see what follows it
            joined = joined.rstrip()
        return ToolParse(joined, calls)

    def _block(self, text: str, body: int, final: bool) -> tuple[list[ParsedCall] | None, int | None]:
        """The calls of the block whose JSON starts at ``body`` (None: it names none, or not yet),
        and the index past the block (None while it is open)."""
        if self.end is not None:
            close = text.find(self.end, body)
            stop = close if close >= 0 else len(text) - (0 if final else held_prefix(text[body:], self.end))
            inner = text[:stop]
            closed_at = close + len(self.end) if close >= 0 else None
        else:
            inner, closed_at = text, None
        lead = len(inner) - len(inner[body:].lstrip()) if body < len(inner) else body
        first = lead if lead < len(inner) else -1
        if first < 0:
            return None, closed_at
        if self.array:
            if inner[first] != "[":
                return None, first
            objects, array_end = scan_array(inner, first)
            if self.end is None:
                closed_at = array_end
        elif inner[first] == "{":
            objects = [scan_object(inner, first)]
            if self.end is None:
                closed_at = objects[0].end
        else:
            return None, closed_at if self.end is not None else first
        done = closed_at is not None or final
        calls = [_call(obj, inner, done) for obj in objects if obj.name is not None]
        return (calls or None), closed_at


def _call(obj: ObjectScan, text: str, block_done: bool) -> ParsedCall:
    closed = obj.end is not None or block_done
    arguments = obj.arguments(text)
    if closed and not arguments:
        arguments = "{}"
    return ParsedCall(obj.name or "", arguments, closed)
