"""One sampled continuation of a prompt, as the engine makes it and a job's result stores it.

Apart from ``engine/generation_types.py``, which holds tensors, so the API reads stored results
(``domain.jobs.results.JobResult``) without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.sampling_mask import unpack


@dataclass
class Choice:
    index: int
    token_ids: list[int]
    # Per token, its logprob under the raw distribution (or the processed one, under logprobs_mode
    # "processed": engine/processed_rows.py); None unless asked.
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "abort" | "policy_lag" (SamplingParams.max_policy_lag)
    # The stop token id (eos included) or stop string that ended the choice; None otherwise.
    matched_stop: int | str | None = None
    text: str | None = None  # detokenized tokens (see RowDecoder.text); None without detokenize
    # Per token, [[token_id, logprob], ...] of the top_logprobs most likely tokens (of the
    # logprobs_mode distribution: RowDecoder.top_logprobs); None unless asked.
    top_logprobs: list[list[list]] | None = None
    # With sampling_mask: {"token_ids": [...], "offsets": [...]}, CSR over the tokens (vLLM's
    # SamplingMask): token i could have been drawn from token_ids[offsets[i]:offsets[i + 1]]. The
    # engine's choice holds it packed (engine/sampling_mask.py ``pack``), as the result stores it;
    # a choice read from a record (``from_record``) holds the lists.
    sampling_mask: dict[str, list[int]] | dict[str, str] | None = None
    # [{version, start, end}], half-open over token_ids: which weights made which tokens (a row
    # continued across an update, mode keep, has several; engine/row_versions.py).
    weight_versions: list[dict] | None = None
    # None: the row crossed no weight update; True: its earlier tokens' KV was computed again by
    # the new weights at every update it crossed (recompute_kv); False: it attended to the KV
    # the older weights computed.
    kv_recomputed: bool | None = None
    # With routed_experts: the top-k expert ids of every MoE layer at every position fed to the
    # model (prompt + output - 1), packed {dtype, shape: [tokens, layers, k], data: base64}
    # (engine/routing/encoding.py); None unless asked.
    routed_experts: dict | None = None

    @classmethod
    def from_record(cls, record: dict) -> Choice:
        """A stored choice (``dataclasses.asdict`` of one), ignoring keys this version does not know;
        its mask unpacked."""
        choice = cls(**{f.name: record[f.name] for f in fields(cls) if f.name in record})
        choice.sampling_mask = unpack(choice.sampling_mask)
        return choice

    @classmethod
    def aborted(cls, index: int) -> Choice:
        """The empty choice of a job that ended before it ran (cancelled while queued, failed)."""
        return cls(index=index, token_ids=[], logprobs=[], finish_reason="abort", text="", top_logprobs=[])
