"""A request's grammar in the scheduler's terms: started when it is submitted, waited on before
admission (a compiling grammar holds its request back, never the batch), one matcher per row.
xgrammar is imported only when a request carries a constraint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from engine.errors import RolloutError
from engine.grammar.errors import InvalidGrammarError
from engine.grammar.spec import FIELD


def check_grammar(facts: Any, params: Any) -> None:
    """Refuse a constraint the model cannot take: it is compiled against the model's tokenizer."""
    if params.structured_output is not None and facts.tokenizer is None:
        raise InvalidGrammarError("structured outputs need the model's tokenizer, which this model directory lacks",
                                  errors={FIELD: ["not supported by this model"]})


def start_grammar(facts: Any, params: Any) -> Any:
    """The request's :class:`engine.grammar.compiler.PendingGrammar` (compiling now, or cached),
    or None for a free request."""
    if params.structured_output is None:
        return None
    from engine.grammar.compiler import model_grammars

    grammars = model_grammars(facts.tokenizer, facts.vocab_size, facts.eos_token_ids)
    return grammars.start(params.structured_output)


def row_grammar(pending: Any, facts: Any) -> Any:
    """A row's own matcher over the request's grammar (None for a free request)."""
    if pending is None:
        return None
    from engine.grammar.row_grammar import RowGrammar

    return RowGrammar(pending, facts.eos_token_ids)


def admissible(pending: Sequence[Any], fail: Callable[[Any, BaseException], None]) -> Sequence[Any]:
    """The pending jobs admission may take now: all but those whose grammar still compiles; a job
    whose grammar was refused (invalid, or not compiled in time) ends with that error."""
    if all(job.grammar is None for job in pending):
        return pending
    ready = []
    for job in pending:
        if job.grammar is not None and job.error is None:
            try:
                if job.grammar.poll() is None:
                    continue
            except RolloutError as error:
                fail(job, error)
        if job.error is None:
            ready.append(job)
    return ready


def wait_for_grammars(pending: Sequence[Any], timeout_s: float = 0.05) -> None:
    """Nothing runs and every pending job waits on its grammar: wait (a while at most) for the
    first compile to end, so an idle scheduler's caller does not spin on it."""
    compiling = [job.grammar.future for job in pending if job.grammar is not None and not job.grammar.future.done()]
    if compiling and len(compiling) == len(pending):
        wait(compiling, timeout=timeout_s, return_when=FIRST_COMPLETED)
