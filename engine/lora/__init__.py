"""LoRA adapters on the one base model: PEFT-format adapters read and checked against the base
(:mod:`engine.lora.adapter_files`), and the resident adapters applied per row, so rows of
different adapters and the base share a forward (:mod:`engine.lora.bank`)."""
