"""Random PEFT adapters for tests, and PEFT's forward as the reference."""

from __future__ import annotations

from pathlib import Path

import torch


def decoder_linears(model, suffixes) -> list[str]:
    """Full names of the language model's linear modules ending in one of ``suffixes``."""
    from engine.lora.adapter_files import adaptable_modules

    return [name for name in adaptable_modules(model) if name.rsplit(".", 1)[-1] in suffixes]


def make_adapter(model_dir: Path, out: Path, *, rank: int, alpha: float, seed: int, use_rslora: bool = False,
                 suffixes=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                 head: bool = False) -> Path:
    """A PEFT LoRA adapter with random A and B (``init_lora_weights=False``) saved by PEFT's
    ``save_pretrained`` into ``out``: what a trainer hands the service."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM

    try:
        base = AutoModelForMultimodalLM.from_pretrained(model_dir, dtype=torch.float32)
    except ValueError:  # a text-only architecture
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = decoder_linears(base, suffixes) + (["lm_head"] if head else [])
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                        use_rslora=use_rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():  # small values, so the adapter moves the logits without blowing them up
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(0.5)
    model.save_pretrained(out, save_embedding_layers=False)  # the base's own head is not the adapter's
    return out


def peft_reference(model_dir: Path, adapter_dir: Path | None, hf_processor=None):
    """tests/fidelity.py's ``Reference`` whose model is ``PeftModel`` over the base (the base
    alone when ``adapter_dir`` is None)."""
    from peft import PeftModel

    from tests.fidelity import Reference

    reference = Reference(model_dir, hf_processor)
    if adapter_dir is not None:
        reference.model = PeftModel.from_pretrained(reference.model, adapter_dir).eval()
    return reference
