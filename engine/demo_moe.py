"""The mixture-of-experts demos, every decoder layer sparse (8 experts, top 2 per token), so that the
routing each token took (engine/routing/) has something to record: a tiny Qwen3-MoE text model
(transformers' ``Qwen3MoeForCausalLM``: Qwen's special tokens, its chat template for string
contents) and a tiny Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL's vision tower
and processor over the same sparse text layers)."""

from __future__ import annotations

from pathlib import Path

from engine.demo_archs import (
    _QWEN_CHAT_TEMPLATE,
    _QWEN_SPECIALS,
    _TEXT,
    ArchSpec,
    _qwen_ids,
    _qwen_text,
    _save_qwen_image_processor,
)

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Few enough experts to build in milliseconds, enough that top-2 routing varies token to token.
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
       "norm_topk_prob": True, "mlp_only_layers": []}


def _write_qwen3_moe(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **{**_TEXT, "head_dim": 16}, **MOE,
        vocab_size=len(tokenizer),
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        architectures=["Qwen3MoeForCausalLM"],
    )
    return Qwen3MoeForCausalLM, config


QWEN3_MOE = ArchSpec(_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _QWEN_CHAT_TEMPLATE, _write_qwen3_moe)


def _write_qwen3_vl_moe(out: Path, tokenizer, ids: dict[str, int]) -> tuple[type, object]:
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    config = Qwen3VLMoeConfig(
        text_config=_qwen_text(tokenizer, ids, head_dim=16, **MOE, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [1]},
        **_qwen_ids(ids),
        architectures=["Qwen3VLMoeForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    _save_qwen_image_processor(out, 16)
    return Qwen3VLMoeForConditionalGeneration, config


QWEN3_VL_MOE = ArchSpec(_QWEN_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _QWEN_CHAT_TEMPLATE, _write_qwen3_vl_moe)
