"""The mixture-of-experts demo: a tiny Qwen3-MoE text model (transformers' ``Qwen3MoeForCausalLM``),
every decoder layer sparse (8 experts, top 2 per token, ``norm_topk_prob``), so that the routing
each token took (engine/routing/) has something to record. Text only: Qwen's special tokens and
its chat template for string contents."""

from __future__ import annotations

from pathlib import Path

from engine.demo_archs import _QWEN_CHAT_TEMPLATE, _TEXT, ArchSpec

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
