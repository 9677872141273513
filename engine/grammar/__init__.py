"""Structured outputs valid by construction: a request's constraint (a JSON schema, any JSON
object, a regex, a choice of strings, an EBNF grammar) compiled by xgrammar against the model's
tokenizer, and each constrained row's token bitmask applied inside the batched sampler.

- :mod:`engine.grammar.spec`: the constraint as a request carries it (free of torch: the API checks it);
- :mod:`engine.grammar.compiler`: one compiler per model, compiles off the stepping thread, cached per constraint;
- :mod:`engine.grammar.row_grammar`: a row's matcher state and the step's batched bitmask.

Importing this package loads neither torch nor xgrammar.
"""
