"""Text-only models (Qwen3-MoE): no media, so no placeholders and no features; the "HF processor"
is the model's tokenizer itself (``AutoProcessor`` gives a bare tokenizer for a directory with no
processor config, and a tokenizer has no ``.tokenizer``)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from processors.base import MultimodalProcessor
from processors.registration import register_processor


@register_processor("Qwen3MoeForCausalLM")
class TextOnlyProcessor(MultimodalProcessor):
    modalities = frozenset()
    feature_names = frozenset()

    def load_hf_processor(self, model_dir: Path):
        return AutoTokenizer.from_pretrained(model_dir)

    @property
    def tokenizer(self):
        return self.hf

    def normalize_prompt(self, prompt: str) -> tuple[str, int]:
        """No media markers to normalize (an empty alternation would match everywhere)."""
        return prompt, 0
