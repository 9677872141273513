"""One step's tokens for every row at once (engine/batch_sampler.py, engine/sampling.py): greedy
rows take the argmax, no row draws a media placeholder, logprobs are the raw distribution's, a
row that fails ends its own job only, and a seeded row draws the same tokens alone or in any
batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.batch_sampler import sample_step
from engine.decoding import RowDecoder
from engine.sampling_params import SamplingParams

PLACEHOLDER = 3


def job(tag):
    return SimpleNamespace(tag=tag, peak_rows=0, first_token_at=None)


def row(**params) -> RowDecoder:
    return RowDecoder(0, 0, SamplingParams(max_tokens=4, **params), None)


def test_greedy_rows_take_the_argmax_but_never_a_placeholder_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0], [5.0, 1.0, 0.0, 0.0]])
    rows, jobs, events, failed = [row(temperature=0), row(temperature=0)], [job("a"), job("b")], [], []
    tokens = sample_step(rows, jobs, logits, placeholder_ids=torch.tensor([PLACEHOLDER]), events=events,
                         batch_rows=5, fail=lambda j, e: failed.append(j))
    assert tokens.tolist() == [2, 0] and [r.token_ids for r in rows] == [[2], [0]]
    raw = torch.log_softmax(logits, dim=-1)  # the placeholder's mass stays in the distribution
    assert rows[0].logprobs() == pytest.approx([float(raw[0, 2])]) and rows[1].logprobs() == pytest.approx([float(raw[1, 0])])
    assert [(e.tag, e.token_id) for e in events] == [("a", 2), ("b", 0)] and failed == []
    assert all(j.peak_rows == 5 and j.first_token_at is not None for j in jobs)


def test_a_row_that_raises_ends_its_own_job_and_the_others_go_on():
    class Broken(RowDecoder):
        adjusts = True

        def adjust(self, raw):
            raise RuntimeError("this row's sampler broke")

    broken = Broken(0, 0, SamplingParams(max_tokens=4, temperature=1.0), torch.Generator().manual_seed(0))
    fine = row(temperature=0)
    jobs, failed = [job("broken"), job("fine")], []
    sample_step([broken, fine], jobs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]),
                placeholder_ids=None, events=[], batch_rows=2, fail=lambda j, e: failed.append((j.tag, str(e))))
    assert failed == [("broken", "this row's sampler broke")]
    assert broken.token_ids == [] and fine.token_ids == [2]


def test_rows_already_done_take_no_token():
    done = row(temperature=0)
    done.abort()
    events = []
    sample_step([done], [job("x")], torch.zeros(1, 4), placeholder_ids=None, events=events, batch_rows=1,
                fail=lambda j, e: None)
    assert done.token_ids == [] and events == [] and done.finish_reason == "abort"


def test_a_seeded_row_draws_the_same_tokens_alone_and_beside_any_rows():
    from engine.sampling import sample_row, sample_rows

    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=1.3, top_k=20),
              SamplingParams(temperature=1.0, min_p=0.05, seed=2), SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, top_k=7, top_p=0.8, seed=3)]

    def generators():
        return [torch.Generator().manual_seed(s) if p.seed is not None else None for s, p in enumerate(params)]

    alone_gens, batch_gens = generators(), generators()
    for _ in range(20):  # generators advance step by step, alone and batched alike
        batched = sample_rows(logits, params, batch_gens)
        for i, p in enumerate(params):
            if p.seed is not None:
                assert int(sample_row(logits[i], p, alone_gens[i])) == int(batched[i])
        assert int(batched[3]) == int(logits[3].argmax())


def test_the_draw_follows_the_truncated_distribution():
    from engine.sampling import sample_rows

    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    # top_p 0.8 keeps 0.4, 0.3, 0.15 (the mass before 0.1 is 0.85); top_k 2 keeps the first two.
    cases = {"top_p": (SamplingParams(temperature=1.0, top_p=0.8), [0.4, 0.3, 0.15, 0, 0]),
             "top_k": (SamplingParams(temperature=1.0, top_k=2), [0.4, 0.3, 0, 0, 0]),
             "min_p": (SamplingParams(temperature=1.0, min_p=0.3), [0.4, 0.3, 0.15, 0, 0])}
    draws = 20_000
    for name, (params, kept) in cases.items():
        generator = torch.Generator().manual_seed(7)
        tokens = sample_rows(logits.expand(draws, 5), [params] * draws, [generator] * draws)
        frequency = torch.bincount(tokens, minlength=5).double() / draws
        expected = torch.tensor(kept, dtype=torch.double) / sum(kept)
        assert torch.allclose(frequency, expected, atol=0.015), (name, frequency.tolist())
