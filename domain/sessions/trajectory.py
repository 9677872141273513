"""A session's trajectory as a trainer reads it: per segment one token sequence, its loss mask (1
for a token the model sampled, 0 for one it was given), and per token the sampled one's logprob
and the weight version that made it (None for given tokens).

A turn whose prompt starts with its segment's whole sequence (the last turn's prompt and sampled
ids: a continued turn, or a token-in turn that stitched them itself) adds to that segment only
the prompt ids after it and its sampled ids; any other turn starts a new segment with its whole
prompt. One conversation continued turn over turn is one segment."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TurnEntry:
    turn: int  # the session's turn number, from 1
    segment: int
    given: list[int]  # the prompt ids this turn added to its segment
    sampled: list[int]
    logprobs: list[float] | None  # per sampled id
    weight_versions: list[dict]  # [{version, start, end}] over the sampled ids
    prompt: str  # how its prompt was made: continued | rendered | tokens
    reason: str | None = None  # why a chat turn was rendered, not continued

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TurnEntry:
        return cls(**record)


def per_token_versions(spans: list[dict], count: int) -> list[str | None]:
    out: list[str | None] = [None] * count
    for span in spans:
        for i in range(max(0, span["start"]), min(count, span["end"])):
            out[i] = span["version"]
    return out


def segment_view(entries: list[TurnEntry]) -> dict[str, Any]:
    """One segment's entries (in turn order) as one sequence with its mask, logprobs and versions."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float | None] = []
    versions: list[str | None] = []
    turns = []
    for entry in entries:
        turns.append({"turn": entry.turn, "start": len(ids), "sampled_start": len(ids) + len(entry.given),
                      "prompt": entry.prompt, "reason": entry.reason})
        ids += entry.given
        mask += [0] * len(entry.given)
        logprobs += [None] * len(entry.given)
        versions += [None] * len(entry.given)
        ids += entry.sampled
        mask += [1] * len(entry.sampled)
        logprobs += list(entry.logprobs) if entry.logprobs is not None else [None] * len(entry.sampled)
        versions += per_token_versions(entry.weight_versions, len(entry.sampled))
    return {"segment": entries[0].segment if entries else 0, "token_ids": ids, "loss_mask": mask,
            "logprobs": logprobs, "weight_versions": versions, "turns": turns}
