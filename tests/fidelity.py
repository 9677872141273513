"""The reference every logprob the service returns is checked against: transformers' own forward.

A trainer feeds our logprobs into its loss, so the only acceptable answer is the model's own: the
log-softmax of the logits transformers' forward gives for one unpadded sequence, its media passed
as the model takes them and ``mm_token_type_ids`` built by the model's own HF processor. Nothing
here uses the engine: a reference computed by the path under test would check nothing.

The registry is enumerated, not listed: :func:`registry_cases` yields (registered architecture,
modality) for every processor the service can load, and :func:`demo_dirs` maps each registered
name to a demo model built offline; a processor registered without a demo model fails loudly.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tests.media_files import mp4_bytes, png_bytes, wav_bytes

TOLERANCE = 1e-4  # fp32 CPU; measured differences are ~1e-6


def registered_name(architecture: str, vision_model_type: str | None) -> str:
    """A registry entry's name as ``processors.registry.supported_architectures`` spells it."""
    return f"{architecture} (vision: {vision_model_type})" if vision_model_type else architecture


def registry_cases():
    """``pytest.param(registered, modality)`` for every registered processor and every modality it
    takes, text included: what is added to the registry later is covered without editing a test."""
    from processors.registry import REGISTRY, supported_architectures

    for name in supported_architectures():
        architecture, _, vision = name.partition(" (vision: ")
        cls = REGISTRY.processor_class(architecture, vision.rstrip(")") or None)
        for modality in ("text", *sorted(cls.modalities)):
            yield pytest.param(name, modality, id=f"{name.replace(' ', '')}-{modality}")


def demo_dirs(root: Path) -> dict[str, Path]:
    """Every demo architecture built under ``root``, keyed by the registry name that serves it."""
    from transformers import AutoConfig

    from engine.demo_model import ARCHS, build_demo_model

    out = {}
    for arch in ARCHS:
        directory = build_demo_model(root / arch, arch=arch)
        config = AutoConfig.from_pretrained(directory)
        vision = getattr(getattr(config, "vision_config", None), "model_type", None)
        out[registered_name(config.architectures[0], vision)] = directory
        # A tower registered only for its own architecture (no vision-specific entry) still serves.
        out.setdefault(config.architectures[0], directory)
    return out


def demo_dir_for(dirs: Mapping[str, Path], registered: str) -> Path:
    if registered not in dirs:
        pytest.fail(f"{registered} is registered but engine/demo_model.py builds no model of it: "
                    "add one, so that the fidelity contract covers it")
    return dirs[registered]


def data_url(modality: str, seed: int = 0, **size) -> str:
    if modality == "image":
        return "data:image/png;base64," + base64.b64encode(png_bytes(seed=seed, **size)).decode()
    if modality == "video":
        return "data:video/mp4;base64," + base64.b64encode(mp4_bytes(seed=seed, **size)).decode()
    return "data:audio/wav;base64," + base64.b64encode(wav_bytes(seed=seed, **size)).decode()


# Two sizes per modality, so batched rows carry media of other shapes.
MEDIA_SIZES = {
    "image": ({"width": 64, "height": 48}, {"width": 40, "height": 90}),
    "video": ({"frames": 4, "width": 64, "height": 48}, {"frames": 2, "width": 40, "height": 56}),
    "audio": ({"seconds": 1.0}, {"seconds": 0.5}),
}


def content_part(modality: str, variant: int = 0) -> dict:
    kind = {"image": "image_url", "video": "video_url", "audio": "audio_url"}[modality]
    return {"type": kind, "url": data_url(modality, seed=variant + 1, **MEDIA_SIZES[modality][variant])}


@dataclass
class Prompt:
    """A prompt as the GPU side receives it: token ids (pads expanded) and finalized items."""

    token_ids: list[int]
    items: list  # engine.items.MultimodalItem with real tensors (handles opened)
    parts: list[dict]  # the content parts it was made from (empty for text)
    text: str


def make_prompt(processor, modality: str, variant: int = 0, text: str = "Describe it briefly.") -> Prompt:
    """A prompt of ``modality`` made by the service's own preprocessing (fetch from a data: URL,
    the model's HF processor, placeholder expansion)."""
    from engine.limits import Limits
    from engine.transport import InlineTransport, open_feature
    from processors.fetch import FetchPolicy, GuardedFetcher
    from processors.pipeline import preprocess

    if modality == "text":
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Prompt(ids, [], [], text)
    parts = [content_part(modality, variant)]
    prompt = f"{processor.native_placeholder(modality)} {text}"
    done = preprocess({"prompt": prompt, "content_parts": parts}, processor=processor,
                      fetcher=GuardedFetcher(FetchPolicy()), cache=None, transport=InlineTransport(),
                      limits=Limits())
    items = [replace(item, features={k: open_feature(v) for k, v in item.features.items()})
             for item in done.items]
    return Prompt(list(done.prompt_token_ids), items, parts, prompt)


class Reference:
    """transformers' forward of the demo model in ``model_dir`` (fp32, eval), one sequence at a time."""

    def __init__(self, model_dir: Path, hf_processor):
        """``hf_processor``: the model's HF processor (``processor.hf``: AutoProcessor itself needs
        torchvision for some models, which this project never installs)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMultimodalLM

        # A text-only model (Qwen3-MoE) is a causal LM, not a multimodal one.
        auto = AutoModelForMultimodalLM
        if type(AutoConfig.from_pretrained(model_dir)) not in auto._model_mapping:
            auto = AutoModelForCausalLM
        self.model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.hf_processor = hf_processor
        self._takes_types = "mm_token_type_ids" in getattr(self.hf_processor, "model_input_names", ())

    def distributions(self, token_ids: Sequence[int], items: Sequence = ()) -> torch.Tensor:
        """(len, vocab): row t is the log-distribution of the token after ``token_ids[t]``."""
        input_ids = torch.tensor([list(token_ids)])
        kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        if items:
            # The features as the model's HF processor made them, items in prompt order.
            for name in items[0].features:
                kwargs[name] = torch.cat([item.features[name] for item in items])
            if self._takes_types:
                types = self.hf_processor.create_mm_token_type_ids(input_ids.tolist())
                kwargs["mm_token_type_ids"] = torch.tensor(types)
        with torch.inference_mode():
            logits = self.model(**kwargs).logits
        return torch.log_softmax(logits[0].float(), dim=-1)

    def token_logprobs(self, prompt: Sequence[int], completion: Sequence[int], items: Sequence = ()) -> list[float]:
        """The logprob of each completion token after the prompt and the completion before it."""
        dists = self.distributions([*prompt, *completion], items)
        start = len(prompt) - 1
        return [float(dists[start + i, token]) for i, token in enumerate(completion)]

    def prompt_logprobs(self, prompt: Sequence[int], items: Sequence = ()) -> list[float]:
        """Each prompt token's logprob after the tokens before it, from the second token on."""
        dists = self.distributions(prompt, items)
        return [float(dists[i - 1, token]) for i, token in enumerate(prompt) if i]


def assert_close(got: Sequence[float], want: Sequence[float], what: str) -> float:
    """Equal to :data:`TOLERANCE` element by element; returns the worst difference."""
    assert len(got) == len(want), f"{what}: {len(got)} logprobs, the model's forward gives {len(want)}"
    worst = max((abs(g - w) for g, w in zip(got, want, strict=True)), default=0.0)
    assert worst <= TOLERANCE, f"{what}: differs from transformers' forward by {worst:.3g} (got {got}, want {want})"
    return worst


def assert_top_logprobs(top: Sequence[Sequence], reference: Reference, prompt, completion, items, k: int,
                        what: str) -> None:
    """Each step's ``[[token_id, logprob], ...]`` holds the k most likely tokens of the model's
    distribution with their logprobs (near-ties may swap places; their values may not)."""
    dists = reference.distributions([*prompt, *completion], items)
    start = len(prompt) - 1
    assert len(top) == len(completion), what
    for i, step in enumerate(top):
        row = dists[start + i]
        assert len(step) == k, f"{what}: step {i} has {len(step)} alternatives, asked {k}"
        want = torch.topk(row, k).values.tolist()
        assert_close([value for _, value in step], want, f"{what} step {i} values")
        assert_close([value for _, value in step], [float(row[token]) for token, _ in step], f"{what} step {i} ids")


def poison_free_blocks(engine) -> None:
    """NaN in every block of ``engine``'s KV pool (after dropping what it caches, which nothing
    holds between requests): what a request whose forward overflowed leaves behind."""
    engine.forget_cached()
    pool = engine.kv_pool
    assert pool.in_use == 0 and pool.keys, "poison a materialized pool between requests"
    for layer in (*pool.keys, *pool.values):
        layer[:, 1:] = float("nan")  # every block but the null one, which no row ever writes
