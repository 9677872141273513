"""The typed refusals of a structured-output constraint (422s, as every InvalidRequestError).

Here, not in ``engine.errors``, beside the constraint they refuse; the API imports this module
(through ``engine.sampling_params``), so a failed job's stored code reads back as its type."""

from __future__ import annotations

from engine.errors import InvalidRequestError


class InvalidGrammarError(InvalidRequestError):
    """The constraint cannot be compiled: a JSON schema xgrammar does not support, a regex or an
    EBNF grammar that does not parse, a choice list of the wrong shape."""

    code = "invalid_grammar"


class GrammarTooComplexError(InvalidRequestError):
    """The constraint is larger than the service compiles, or did not compile in the time allowed."""

    code = "grammar_too_complex"
