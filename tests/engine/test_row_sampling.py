"""Each row's token from one forward's logits (engine/row_sampling.py): greedy rows take the
argmax, no row draws a media placeholder, logprobs are the raw distribution's, and a row that
fails ends its own job only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.decoding import RowDecoder
from engine.row_sampling import sample_rows
from engine.sampling_params import SamplingParams

PLACEHOLDER = 3


def job(tag):
    return SimpleNamespace(tag=tag, peak_rows=0, first_token_at=None)


def row(**params) -> RowDecoder:
    return RowDecoder(0, 0, SamplingParams(max_tokens=4, **params), None)


def test_greedy_rows_take_the_argmax_but_never_a_placeholder_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0], [5.0, 1.0, 0.0, 0.0]])
    rows, jobs, events, failed = [row(temperature=0), row(temperature=0)], [job("a"), job("b")], [], []
    tokens = sample_rows(rows, jobs, logits, placeholder_ids=torch.tensor([PLACEHOLDER]), events=events,
                         batch_rows=5, fail=lambda j, e: failed.append(j))
    assert tokens.tolist() == [2, 0] and [r.token_ids for r in rows] == [[2], [0]]
    raw = torch.log_softmax(logits, dim=-1)  # the placeholder's mass stays in the distribution
    assert rows[0].logprobs() == pytest.approx([float(raw[0, 2])]) and rows[1].logprobs() == pytest.approx([float(raw[1, 0])])
    assert [(e.tag, e.token_id) for e in events] == [("a", 2), ("b", 0)] and failed == []
    assert all(j.peak_rows == 5 and j.first_token_at is not None for j in jobs)


def test_a_row_that_raises_ends_its_own_job_and_the_others_go_on():
    class Broken(RowDecoder):
        def pick(self, raw):
            raise RuntimeError("this row's sampler broke")

    broken = Broken(0, 0, SamplingParams(max_tokens=4, temperature=1.0), torch.Generator().manual_seed(0))
    fine = row(temperature=0)
    jobs, failed = [job("broken"), job("fine")], []
    sample_rows([broken, fine], jobs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]),
                placeholder_ids=None, events=[], batch_rows=2, fail=lambda j, e: failed.append((j.tag, str(e))))
    assert failed == [("broken", "this row's sampler broke")]
    assert broken.token_ids == [] and fine.token_ids == [2]


def test_rows_already_done_take_no_token():
    done = row(temperature=0)
    done.abort()
    events = []
    sample_rows([done], [job("x")], torch.zeros(1, 4), placeholder_ids=None, events=events, batch_rows=1,
                fail=lambda j, e: None)
    assert done.token_ids == [] and events == [] and done.finish_reason == "abort"
