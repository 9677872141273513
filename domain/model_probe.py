"""What the API must know of the model, found by transformers itself, without torch in the API.

The API needs the model's facts (``domain.models.ModelFacts``, from its config) and its tokenizer.
transformers' config classes import torch on import (``configuration_utils`` →
``modeling_rope_utils``), ``AutoTokenizer`` imports them to pick a tokenizer class, and neither has
a switch to turn that off; the tokenizer classes themselves import no torch. So a process without
torch asks a short-lived child process, which runs ``AutoConfig`` and ``AutoTokenizer`` and reports
the facts and the name of the tokenizer class picked. The asker then loads that class itself
(:func:`load_tokenizer`): the very tokenizer ``AutoTokenizer`` gives, so token texts and chat
templates are the same as a worker's. A process already holding torch (a worker, a test) probes in
place. Answers are cached under the state dir by the content of the model's config files, so the
API processes after the first start at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from domain.models import ModelFacts, model_facts
from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

# What decides the answer: the files AutoConfig and AutoTokenizer read to choose (the tokenizer's
# own files are read by the class when it loads, in every process alike).
_DECIDING_FILES = ("config.json", "tokenizer_config.json")
_CHILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class ModelProbe:
    facts: ModelFacts
    # The class AutoTokenizer picks, by its name in transformers' namespace.
    tokenizer_class: str


def probe(model_path: str, *, cache_dir: Path | None = None) -> ModelProbe:
    """The model's probe: in place when this process holds torch, else from the cache or a child."""
    if "torch" in sys.modules:
        return probe_here(model_path)
    cache = _cache_file(model_path, cache_dir)
    if cache is not None and cache.is_file():
        try:
            return _from_json(json.loads(cache.read_text()))
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable model probe cache file %s", cache)
    found = _probe_in_child(model_path)
    if cache is not None:
        _write_atomically(cache, json.dumps(_to_json(found)))
    return found


def probe_here(model_path: str) -> ModelProbe:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load the tokenizer of {model_path!r}: {error}") from error
    return ModelProbe(model_facts(model_path), type(tokenizer).__name__)


def load_tokenizer(model_path: str, class_name: str):
    """The tokenizer ``AutoTokenizer`` picks for ``model_path``, loaded without torch."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        # Not a class transformers exports (remote code): AutoTokenizer, torch and all.
        log.warning("tokenizer class %s is not in transformers; loading it with AutoTokenizer", class_name)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    return cls.from_pretrained(model_path)


def _probe_in_child(model_path: str) -> ModelProbe:
    done = subprocess.run([sys.executable, "-m", "domain.model_probe", model_path], capture_output=True,
                          text=True, timeout=_CHILD_TIMEOUT_S, env={**os.environ, "PYTHONPATH": _import_root()})
    if done.returncode != 0:
        raise ModelLoadError(f"cannot read the model {model_path!r}: {_last_line(done.stderr)}")
    return _from_json(json.loads(done.stdout.strip().splitlines()[-1]))


def _import_root() -> str:
    # The child imports this package as the asker does, installed or from a checkout.
    root = str(Path(__file__).resolve().parent.parent)
    inherited = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{inherited}" if inherited else root


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "the probe process failed"


def _cache_file(model_path: str, cache_dir: Path | None) -> Path | None:
    local = Path(model_path)
    if cache_dir is None or not local.is_dir():
        return None  # a hub id: nothing local to key the answer by
    digest = hashlib.sha256(_transformers_version().encode())
    for name in _DECIDING_FILES:
        file = local / name
        digest.update(name.encode() + b"\0" + (file.read_bytes() if file.is_file() else b"-") + b"\0")
    return Path(cache_dir) / f"{digest.hexdigest()[:32]}.json"


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
            out.write(text)
        os.replace(out.name, path)
    except OSError as error:  # a read-only state dir: probe again next start
        log.warning("cannot cache the model probe in %s: %s", path.parent, error)


_ID_SETS = ("media_token_ids", "placeholder_token_ids")  # ModelFacts' frozensets, lists in JSON


def _to_json(found: ModelProbe) -> dict:
    facts = dataclasses.asdict(found.facts)
    for name in _ID_SETS:
        facts[name] = sorted(facts[name])
    return {"facts": facts, "tokenizer_class": found.tokenizer_class}


def _from_json(data: dict) -> ModelProbe:
    facts = dict(data["facts"])
    if set(facts) != {field.name for field in dataclasses.fields(ModelFacts)}:
        raise KeyError("a probe of another build")  # probed again, so no fact is left at its default
    for name in _ID_SETS:
        facts[name] = frozenset(facts[name])
    return ModelProbe(ModelFacts(**facts), str(data["tokenizer_class"]))


def main(argv: list[str]) -> int:
    """``python -m domain.model_probe PATH``: print the probe as one JSON line."""
    try:
        found = probe_here(argv[0])
    except Exception as error:  # noqa: BLE001 - whatever transformers raises, the asker gets one line
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(_to_json(found)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
