"""What structured outputs cost (issue #57 item 2): compiling a constraint, and decoding under one.

Compile: a JSON schema of 24 properties (enums, bounded strings and integers, an array) through
``engine.grammar.compiler.ModelGrammars`` on the demo tokenizer (640 ids) and on a synthetic
byte-level vocabulary of 151,643 ids (Qwen2's size: what a real model's compile costs), cold
(the tokenizer's info built on the first compile is reported apart) and again (the cache).

Decode: the bench-sized Qwen2-VL of ``bench/rollout.py`` and the demo model, one process, one
torch thread, 32 rows x 64 tokens at temperature 1, free against ``json_schema`` (one long
string: the grammar fixes ``{"story": "`` and then constrains every token, the rows run to
``max_tokens``). Each five times alternating, the fastest counts. Goal: constrained / free
decode tokens/s >= 0.8.

Run: ``python -m bench.structured_output`` from the repository root.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.rows import print_rows  # noqa: E402

PROMPT = "User: describe a long walk along the sea on a windy day, in many words. Assistant:"
ROWS, NEW = 32, 64
ROUNDS = 5  # alternating; the fastest of each counts (a shared machine's load skews single runs)
STORY = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 4000}}, "required": ["story"]}
BIG = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(24)],
       "properties": {f"field_{i}": ({"enum": [f"value_{i}_{j}" for j in range(6)]} if i % 3 == 0 else
                                     {"type": "string", "maxLength": 32} if i % 3 == 1 else
                                     {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "maxItems": 8}) for i in range(24)}}


def synthetic_tokenizer(size: int = 151_643):
    """A byte-level BPE tokenizer with ``size`` ids of random pieces (no merges: only its
    vocabulary matters to a compile)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZĠ0123456789\"{}[]:,._-"
    while len(vocab) < size - 1:
        vocab.setdefault("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))), len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>"), len(vocab)


def compile_rows(tokenizer, vocab_size: int, eos: int, label: str) -> list[dict]:
    from engine.grammar.compiler import ModelGrammars
    from engine.grammar.spec import GrammarSpec

    grammars = ModelGrammars(tokenizer, vocab_size, [eos], timeout_s=600)
    started = time.perf_counter()
    grammars.compile(GrammarSpec.from_request({"regex": "a"}))  # builds the tokenizer's info
    info = time.perf_counter() - started
    spec = GrammarSpec.from_request({"json_schema": BIG})
    started = time.perf_counter()
    grammars.compile(spec)
    cold = time.perf_counter() - started
    hits = []
    for _ in range(100):
        started = time.perf_counter()
        grammars.start(spec).poll()
        hits.append(time.perf_counter() - started)
    return [{"name": f"compile, {label}: tokenizer info (once per model), ms", "value": round(info * 1e3, 1), "goal": None},
            {"name": f"compile, {label}: 24-property schema cold, ms", "value": round(cold * 1e3, 1), "goal": None},
            {"name": f"compile, {label}: same schema again (cache), ms", "value": round(min(hits) * 1e3, 3),
             "goal": None}]


def seconds(engine, prompt: list[int], constrained: bool) -> tuple[float, int]:
    from engine.generation import GenerationRequest
    from engine.sampling_params import SamplingParams

    extra = {"structured_output": {"json_schema": STORY}} if constrained else {"ignore_eos": True}
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=NEW, temperature=1.0, seed=i, **extra))
                for i in range(ROWS)]
    started = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(r.choices[0].token_ids) for r in results)


def decode_rows(directory: Path, label: str) -> list[dict]:
    from transformers import AutoTokenizer

    from engine.generation import Engine
    from engine.loading import load_model

    engine = Engine(load_model(str(directory), device="cpu"))
    prompt = AutoTokenizer.from_pretrained(directory)(PROMPT, add_special_tokens=False)["input_ids"]
    seconds(engine, prompt, True)  # warm up, and the schema compiled
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for constrained in (False, True):
            elapsed, tokens = seconds(engine, prompt, constrained)
            rates[constrained].append(tokens / elapsed)
    free, constrained = max(rates[False]), max(rates[True])
    step_ms = (1 / constrained - 1 / free) * ROWS * 1e3
    return [{"name": f"decode tok/s, {label}, {ROWS} rows x {NEW}, free", "value": round(free, 1), "goal": None},
            {"name": f"· json_schema / free, {label}", "value": round(constrained / free, 3), "goal": ">= 0.8"},
            {"name": f"· grammar cost per step of {ROWS} rows, {label}, ms", "value": round(step_ms, 2), "goal": None}]


def run() -> list[dict]:
    from transformers import AutoTokenizer

    from bench.rollout import build_bench_model
    from engine.demo_model import build_demo_model

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        demo = build_demo_model(Path(tmp) / "demo")
        demo_tokenizer = AutoTokenizer.from_pretrained(demo)
        rows += compile_rows(demo_tokenizer, len(demo_tokenizer), demo_tokenizer.convert_tokens_to_ids("<|im_end|>"),
                             "demo vocab 640")
        big, size = synthetic_tokenizer()
        rows += compile_rows(big, size, size - 1, f"vocab {size:,}")
        rows += decode_rows(build_bench_model(Path(tmp) / "bench-qwen2-vl"), "bench model")
        rows += decode_rows(demo, "demo model")
    return rows


def main() -> None:
    print_rows(run())


if __name__ == "__main__":
    main()
