"""Compiling a constraint (:class:`engine.grammar.spec.GrammarSpec`) against one model's tokenizer.

Why xgrammar: vLLM's and SGLang's default structured-output backend; it compiles JSON schemas
(``enum``, ``maxLength``, ``required``, ``additionalProperties``...), regexes and EBNF into a
grammar whose per-token masks are precomputed, so a step's mask costs microseconds per row.

One :class:`ModelGrammars` per model (its tokenizer, vocabulary and stop ids: the tokenizer's
info is built once, on the first compile, off the stepping thread). A compile runs on a small
shared thread pool (xgrammar releases the GIL while it compiles), so the scheduler keeps stepping
while a request's grammar compiles and admits it once ready (engine/scheduler.py). Compiled
grammars are kept per constraint in an LRU bounded by their bytes; two requests of one
constraint share one compile. A compile has :data:`COMPILE_TIMEOUT_S`: a request whose grammar
is not ready by then ends with ``grammar_too_complex`` (the compile itself runs on and is cached).
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from engine.grammar.errors import GrammarTooComplexError, InvalidGrammarError
from engine.grammar.spec import FIELD, GrammarSpec

COMPILE_TIMEOUT_S = 10.0
CACHE_BYTES = 256 * 1024 * 1024
# Free-form JSON (json_object) compiles as the schema of any object: xgrammar's builtin JSON
# grammar lets whitespace run on, which a random or undertrained policy can loop in.
_ANY_OBJECT = '{"type":"object"}'
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
# xgrammar's errors start "[12:00:00] /project/cpp/file.cc:123: ": the user needs the rest.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class PendingGrammar:
    """A request's grammar, compiling or compiled."""

    def __init__(self, spec: GrammarSpec, future: Future, timeout_s: float, owner: ModelGrammars | None = None):
        self.spec = spec
        self.owner = owner
        self._future = future
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def poll(self) -> Any:
        """The compiled grammar, or None while it compiles; raises its typed refusal (an invalid
        constraint, or none by the deadline)."""
        if self._future.done():
            return self._future.result()
        if time.monotonic() >= self._deadline:
            raise self._too_slow()
        return None

    def wait(self) -> Any:
        """The compiled grammar, waiting for it until the deadline at most."""
        try:
            return self._future.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except TimeoutError:
            raise self._too_slow() from None

    @property
    def future(self) -> Future:
        return self._future

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer info's vocabulary: logits past it are no token of the grammar."""
        return None if self.owner is None else self.owner.vocab_size

    def extra_mask(self) -> torch.Tensor | None:
        """Words (int32, one bit a token) to AND into every step's bitmask, or None: the ids this
        constraint's output can never hold beyond what xgrammar masks (JSON's raw control characters)."""
        if self.owner is None:
            return None
        if self.spec.kind == "tool_calls":
            return self.owner.no_control_but_space_words
        return self.owner.no_control_words if self.spec.kind in ("json_schema", "json_object") else None

    def _too_slow(self) -> GrammarTooComplexError:
        return GrammarTooComplexError(
            f"the {self.spec.kind} constraint did not compile within {self._timeout_s:g} s",
            errors={FIELD: [f"did not compile within {self._timeout_s:g} s"]})


class ModelGrammars:
    """The grammars of one model: compiled from its tokenizer, cached per constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 cache_bytes: int = CACHE_BYTES, timeout_s: float = COMPILE_TIMEOUT_S):
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache_bytes = cache_bytes
        self._done: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()  # spec -> (grammar, bytes)
        self._held = 0
        self._compiling: dict[GrammarSpec, Future] = {}
        # xgrammar 0.2.9 lets a string with maxLength take raw control characters (its rule is
        # [^"\\\r\n], where an unbounded string's is [^\0-\x1f"\\\r\n]), which JSON forbids; and
        # compact JSON has no other place for one. So JSON rows also mask every token holding one;
        # tool calls keep newline and carriage return (their formats and JSON whitespace use them;
        # xgrammar keeps both out of a string, not a tab).
        self.no_control_words: torch.Tensor | None = None
        self.no_control_but_space_words: torch.Tensor | None = None

    def start(self, spec: GrammarSpec) -> PendingGrammar:
        """``spec``'s grammar: at once from the cache, else compiling on the pool."""
        with self._lock:
            if spec in self._done:
                self._done.move_to_end(spec)
                future: Future = Future()
                future.set_result(self._done[spec][0])
            elif (future := self._compiling.get(spec)) is None:
                future = self._compiling[spec] = _POOL.submit(self._compile, spec)
        return PendingGrammar(spec, future, self.timeout_s, self)

    def compile(self, spec: GrammarSpec) -> Any:
        """``spec``'s compiled grammar, waiting for it (bounded by the timeout)."""
        return self.start(spec).wait()

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            grammar = _compile(self._xgrammar_compiler(), spec)
        except Exception as error:
            raise InvalidGrammarError(
                f"the {spec.kind} constraint does not compile: {_SOURCE_PREFIX.sub('', str(error)).strip()}",
                errors={FIELD: [_SOURCE_PREFIX.sub("", str(error)).strip()[:500]]}) from None
        finally:
            with self._lock:
                self._compiling.pop(spec, None)
        with self._lock:
            self._keep(spec, grammar)
        return grammar

    def _keep(self, spec: GrammarSpec, grammar: Any) -> None:
        size = grammar.memory_size_bytes
        self._done[spec] = (grammar, size)
        self._held += size
        while self._held > self._cache_bytes and len(self._done) > 1:
            _, (_, dropped) = self._done.popitem(last=False)
            self._held -= dropped

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_token_ids))
                self.no_control_words = _words_without(info.decoded_vocab, self.vocab_size, self.stop_token_ids)
                self.no_control_but_space_words = _words_without(info.decoded_vocab, self.vocab_size,
                                                                 self.stop_token_ids, spaces=True)
                # Our LRU keeps the compiled grammars; xgrammar's own cache would hold them twice.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler


def _words_without(decoded_vocab: Sequence[bytes], vocab_size: int, keep: Sequence[int], *,
                   spaces: bool = False) -> torch.Tensor:
    """xgrammar's bitmask words (int32, bit t of word t // 32 for token t) allowing every token
    but those whose bytes hold a control character (stop tokens kept; with ``spaces``, newline
    and carriage return are none)."""
    control = set(range(0x20)) - ({0x0A, 0x0D} if spaces else set())
    allowed = np.ones(xgr.get_bitmask_shape(1, vocab_size)[1] * 32, dtype=bool)
    for token, piece in enumerate(decoded_vocab[:vocab_size]):
        if any(byte in control for byte in piece):
            allowed[token] = False
    allowed[list(keep)] = True
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view("<i4").copy())


def _compile(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> Any:
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=True)
    if spec.kind == "json_object":
        return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "tool_calls":
        calls = json.loads(spec.text)
        # Whitespace inside the arguments' JSON bounded to one character a place: no loops.
        tag = xgr.get_model_structural_tag(calls["format"], tools=calls["tools"], tool_choice=calls["tool_choice"],
                                           reasoning=calls["reasoning"], max_whitespace_cnt=1,
                                           parallel_tool_calls=calls["parallel_tool_calls"])
        return compiler.compile_structural_tag(tag)
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    return compiler.compile_grammar(spec.text)


_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()


def model_grammars(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> ModelGrammars:
    """The one :class:`ModelGrammars` of a tokenizer, vocabulary and stop ids (kept while the
    tokenizer lives)."""
    key = (vocab_size, tuple(stop_token_ids))
    with _MODELS_LOCK:
        per_tokenizer = _MODELS.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            per_tokenizer[key] = ModelGrammars(tokenizer, vocab_size, stop_token_ids)
        return per_tokenizer[key]
