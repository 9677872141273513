"""Tiny random-weight multimodal models, built offline and deterministically.

The service uses one as its demo model when none is configured, and tests build one per
architecture. A build writes a normal Hugging Face model directory (``save_pretrained``), so the
model, tokenizer and image processor load back through ``from_pretrained`` like any hub model.

Builds are byte-identical (fixed seeds, a fixed corpus, JSON written with sorted keys), and a
directory that already holds a complete build of the same format is returned as is.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.demo_archs import SPECS as _ARCH_SPECS
from engine.demo_archs import ArchSpec
from engine.demo_moe import QWEN3_MOE, QWEN3_VL_MOE
from engine.demo_qwen3 import QWEN3_TOOLS

SPECS = {**_ARCH_SPECS, "qwen3_tools": QWEN3_TOOLS, "qwen3_moe": QWEN3_MOE, "qwen3_vl_moe": QWEN3_VL_MOE}

# Bump when what a build writes changes: older builds on disk are then rebuilt.
BUILD_FORMAT = 3
MARKER = "rollout_demo_build.json"
ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "pixtral", "qwen2_5_omni", "qwen2_audio", "qwen3_tools",
         "qwen3_moe", "qwen3_vl_moe")
IMAGE_ARCHS = tuple(arch for arch in ARCHS if arch not in ("qwen2_audio", "qwen3_moe"))
# The one `rollout-queue up` serves: it takes image, video and audio.
SERVED_ARCH = "qwen2_5_omni"

# Small enough to train in milliseconds, varied enough to give a vocabulary of several hundred.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe the image in one sentence. What colour is the square in the picture?
There is a red square on a blue background, and a small green circle near the corner.
The trainer sends token ids and images; the service answers with sampled tokens and logprobs.
Reinforcement learning needs the same tokens on both sides, so nothing is tokenised twice.
Count the objects in the picture and answer with a number. How many cats are on the sofa?
The weather today is sunny with a light breeze from the west, and the sea is calm.
Please answer briefly. Yes. No. Maybe. I do not know. The answer is four.
A man is riding a bicycle along the river while children play football in the park.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14 2.71 -1 +1 = * / ( ) [ ] { } < > , ; : ! ?
The image shows a kitchen with a wooden table, two chairs, a window and a plant on the shelf.
Mathematics: if x + 2 = 5 then x = 3. The sum of the angles of a triangle is 180 degrees.
Code: def f(x): return x * 2; print(f(21)) prints 42. for i in range(10): total += i
User: what is in this photo? Assistant: a dog sitting on the grass in front of a house.
Rollouts are scored offline; every job carries a seed so that results can be reproduced.
"""


def build_demo_model(directory: Path, *, arch: str = "qwen2_vl", seed: int = 0) -> Path:
    """Build (or reuse) a tiny random-weight ``arch`` model in ``directory`` and return it.

    ``arch`` is one of :data:`ARCHS`. ``seed`` draws the random weights: another seed gives the same
    architecture, config and tokenizer with other weights (what an RL step's checkpoint looks like).
    The build is written to a temporary sibling directory and moved into place, so a concurrent
    builder or a crash never leaves a half-written model behind.
    """
    if arch not in SPECS:
        raise ValueError(f"unknown demo arch {arch!r}; choose one of {', '.join(ARCHS)}")
    directory = Path(directory)
    if _is_complete(directory, arch, seed):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        _build(tmp, arch, seed)
        if directory.exists():
            if _is_complete(directory, arch, seed):  # another builder won the race
                return directory
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _marker(arch: str, seed: int) -> dict:
    # Seed 0 writes the marker it always wrote, so existing builds stay valid.
    return {"arch": arch, "format": BUILD_FORMAT} | ({"seed": seed} if seed else {})


def _is_complete(directory: Path, arch: str, seed: int = 0) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(arch, seed)


def _build(out: Path, arch: str, seed: int = 0) -> None:
    spec = SPECS[arch]
    tokenizer = _train_tokenizer(spec)
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in spec.special_tokens}
    tokenizer.save_pretrained(out)
    model_cls, config = spec.write(out, tokenizer, token_ids)
    _save_model(out, model_cls, config, seed)
    _sort_json_files(out)
    # Written last: its presence means the build is complete.
    (out / MARKER).write_text(json.dumps(_marker(arch, seed), sort_keys=True))


def _train_tokenizer(spec: ArchSpec):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=640 - len(spec.special_tokens) - len(spec.added_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    # Special and media tokens after the learned vocabulary, as in real Qwen tokenizers: small ids
    # are ordinary text (SGLang's own example sends input_ids [1, 2, 3]).
    tok.add_special_tokens(list(spec.special_tokens))
    tok.add_tokens([AddedToken(token, special=False, normalized=False) for token in spec.added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        chat_template=spec.chat_template,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        **({"extra_special_tokens": spec.named} if spec.named else {}),
    )


def _sort_json_files(out: Path) -> None:
    # tokenizer.json is serialized by the Rust side in a fixed order and is large; the others
    # come from Python dicts whose order depends on code paths, so sort them.
    for path in sorted(out.glob("*.json")):
        if path.name == "tokenizer.json":
            continue
        data = json.loads(path.read_text())
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _save_model(out: Path, model_cls, config, seed: int) -> None:
    import torch  # here, not at the top: the API resolves an already built demo model without torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out)
