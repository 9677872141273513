"""Load a Hugging Face model for generation and scoring, and describe what the engine needs of it.

:func:`load_model` returns a :class:`LoadedModel`: the model in eval mode on its device, plus the
facts the engine reads on every request (eos and pad ids, context length, media token ids) and
the ``weight_version`` that every result carries so a trainer knows which weights made it.
"""

from __future__ import annotations

import inspect
import re
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from engine.checkpoints import weight_version_of
from engine.errors import ModelLoadError

# Files whose bytes define what the model computes; tokenizer and processor files do not.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel with GenerationMixin
    architecture: str  # e.g. "Qwen2VLForConditionalGeneration"
    model_type: str  # e.g. "qwen2_vl"
    device: torch.device
    dtype: torch.dtype
    weight_version: str
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # The model's own context; the GPU worker sets it to Limits.context_tokens (workers/runtimes.py).
    context_tokens: int | None
    # modality -> placeholder token id, e.g. {"image": 151655, "video": 151656}
    media_token_ids: dict[str, int] = field(default_factory=dict)
    # The model's forward takes ``mm_token_type_ids`` (Qwen-VL M-RoPE in transformers 5.x).
    uses_mm_token_type_ids: bool = False
    # The checkpoint's own generation defaults; the engine does not apply them (see below).
    source_generation_config: Any = None
    # Detokenizes results and matches stop strings; None when the directory has no tokenizer
    # (results then carry no text, and stop strings are refused).
    tokenizer: Any = None
    # generate() keeps per-call state on the model (Qwen-VL's rope_deltas): one call at a time.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # The LoRA adapters resident on the model (engine.lora.bank.AdapterBank); None until one loads.
    adapters: Any = field(default=None, repr=False, compare=False)

    @cached_property
    def vocab_size(self) -> int:
        """Token ids the model can take and score: rows of its input embedding (and of its output
        head, when that has its own size). Cached: weight updates copy into the same tensors
        (engine/weights.py), and transformers' ``get_input_embeddings`` walks the module tree, which
        cost ~5 % of the GPU worker's bulk scoring when read per row (py-spy, bench.service)."""
        size = self.model.get_input_embeddings().num_embeddings
        head = self.model.get_output_embeddings()
        return min(size, head.out_features) if head is not None and hasattr(head, "out_features") else size

    @property
    def fill_token_id(self) -> int:
        """The id used for padding: any id works under an attention mask, so never None."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0


def load_model(
    model_path: str,
    *,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    weight_version: str | None = None,
    local_files_only: bool = False,
) -> LoadedModel:
    """Load ``model_path`` (a local directory or a hub id) for inference.

    ``device``: "auto" (cuda when available), "cpu", "cuda" or "cuda:N". ``dtype``: "auto" is
    float32 on CPU and the checkpoint's dtype on CUDA (float32 checkpoints are kept float32).
    ``weight_version``: given, or a short content hash of the directory's weight and config
    files (a hub id without a local directory uses its resolved commit). Raises
    :class:`ModelLoadError` when the path names no loadable model.
    """
    from transformers import AutoConfig, GenerationConfig

    target = _resolve_device(device)
    local = Path(model_path).expanduser()
    is_hub_id = bool(_HUB_ID.match(model_path)) and not local.exists()
    if not model_path or not (local.is_dir() or is_hub_id):
        raise ModelLoadError(f"model path {model_path!r} is not a directory or a hub id")
    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=local_files_only)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"no loadable model config at {model_path!r}") from exc

    model_cls = _auto_class(config)
    torch_dtype = _resolve_dtype(dtype, target, config)
    try:
        model = model_cls.from_pretrained(
            model_path, dtype=torch_dtype, local_files_only=local_files_only
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model weights from {model_path!r}") from exc
    model.to(target).eval()
    model.requires_grad_(False)

    # The engine applies sampling itself, per request. transformers fills every unset field of
    # the GenerationConfig given to generate() from model.generation_config (repetition penalty,
    # eos ids, top_k...), which would add logits processors before ours and stop on eos even
    # under ignore_eos; a blank one leaves generate() exactly the knobs the engine sets.
    source_generation_config = model.generation_config
    model.generation_config = GenerationConfig()

    text_config = config.get_text_config(decoder=True)
    eos = source_generation_config.eos_token_id
    if eos is None:
        eos = text_config.eos_token_id
    pad = source_generation_config.pad_token_id
    if pad is None:
        pad = getattr(text_config, "pad_token_id", None)

    return LoadedModel(
        model=model,
        architecture=type(model).__name__,
        model_type=config.model_type,
        device=target,
        dtype=model.dtype,
        weight_version=weight_version or _weight_version(model_path, local, config),
        eos_token_ids=_as_ids(eos),
        pad_token_id=pad,
        context_tokens=getattr(text_config, "max_position_embeddings", None),
        media_token_ids=_media_token_ids(config),
        uses_mm_token_type_ids="mm_token_type_ids" in inspect.signature(model.forward).parameters,
        source_generation_config=source_generation_config,
        tokenizer=_load_tokenizer(model_path, local_files_only),
    )


def _load_tokenizer(model_path: str, local_files_only: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=local_files_only)
    except (OSError, ValueError, KeyError):
        return None


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"unsupported device {device!r}; use auto, cpu or cuda[:N]") from exc
    if target.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"unsupported device {device!r}; use auto, cpu or cuda[:N]")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return target


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unsupported dtype {dtype!r}; choose auto or one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls on CPU are slow and less exact
    saved = getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def _auto_class(config: Any):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMultimodalLM

    # Multimodal LM last: it also holds models that take audio but no images (Qwen2-Audio).
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM, AutoModelForMultimodalLM):
        if type(config) in auto._model_mapping:
            return auto
    raise ModelLoadError(f"model type {config.model_type!r} is neither a multimodal nor a causal LM")


def _media_token_ids(config: Any) -> dict[str, int]:
    found = {}
    for modality, names in (
        ("image", ("image_token_id", "image_token_index")),
        ("video", ("video_token_id", "video_token_index")),
        ("audio", ("audio_token_id", "audio_token_index")),
    ):
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int):
                found[modality] = value
                break
    return found


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _weight_version(model_path: str, local: Path, config: Any) -> str:
    if not local.is_dir():
        commit = getattr(config, "_commit_hash", None)
        return f"{model_path}@{commit[:12]}" if commit else model_path
    return weight_version_of(local)


