"""Image-only Hugging Face processors for models whose stock processor needs torchvision.

transformers 5.x builds Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors with a video processor that
imports torchvision (upstream transformers#48558), and ``PixtralProcessor`` cannot even be imported
without it. Their image processors have PIL implementations, so a processor without the video part
works everywhere. The Qwen subclasses are registered with ``AutoProcessor`` on import so that
``AutoProcessor.from_pretrained`` also loads them; Pixtral checkpoints use the LLaVA config class,
which LLaVA's own (working) processor owns in that mapping, so Pixtral's is loaded by class.

Video for the Qwen models is left out here: their video processors need torchvision
(``processors.qwen_video`` builds video features from the image processor instead).
``Qwen2_5OmniProcessorNoVideo`` does the same for the Qwen2.5-Omni thinker (image, audio, text).
"""

from __future__ import annotations

from transformers import AutoProcessor, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without the video processor (its sub-processors: image, tokenizer)."""

    # The signature names the sub-processors ProcessorMixin loads and saves; video is left out.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen2_5_VLImageProcessorOnly(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without the video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen3VLImageProcessorOnly(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without the video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen2_5OmniProcessorNoVideo(Qwen2_5OmniProcessor):
    """``Qwen2_5OmniProcessor`` without the video processor (``video_processor=None`` fails in its
    constructor, so ProcessorMixin's is called directly and the token attributes copied)."""

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None, **kwargs):
        ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        for name in ("image", "audio", "video"):
            setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))
            setattr(self, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
        for name in ("vision_bos_token", "vision_eos_token", "audio_bos_token", "audio_eos_token"):
            setattr(self, name, getattr(tokenizer, name))

    @property
    def model_input_names(self):
        names = [*self.tokenizer.model_input_names, *self.feature_extractor.model_input_names,
                 *self.image_processor.model_input_names, "feature_attention_mask"]
        return list(dict.fromkeys(names))


class PixtralImageOnlyProcessor(ProcessorMixin):
    """Pixtral's processor logic over the PIL image processor.

    Written here because ``transformers.models.pixtral.processing_pixtral`` imports torchvision at
    module level; this mirrors its token layout: per image, rows of ``[IMG]`` each closed by
    ``[IMG_BREAK]``, the last one by ``[IMG_END]``.
    """

    images_kwargs = {"return_tensors": "pt"}
    text_kwargs = {"return_tensors": "pt"}

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        patch_size: int = 16,
        spatial_merge_size: int = 1,
        chat_template=None,
        image_token: str = "[IMG]",
        image_break_token: str = "[IMG_BREAK]",
        image_end_token: str = "[IMG_END]",
        **kwargs,
    ):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.image_token = image_token
        self.image_break_token = image_break_token
        self.image_end_token = image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.image_break_token_id = tokenizer.convert_tokens_to_ids(image_break_token)
        self.image_end_token_id = tokenizer.convert_tokens_to_ids(image_end_token)

    @property
    def image_token_ids(self) -> list[int]:
        return [self.image_token_id, self.image_break_token_id, self.image_end_token_id]

    def _process_images(self, images, **images_kwargs):
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        step = self.patch_size * self.spatial_merge_size
        height, width = (int(v) for v in image_inputs["image_sizes"][image_idx])
        row = [self.image_token] * (width // step) + [self.image_break_token]
        tokens = row * (height // step)
        tokens[-1] = self.image_end_token
        return "".join(tokens)

    @property
    def model_input_names(self):
        return self.tokenizer.model_input_names + self.image_processor.model_input_names + ["image_sizes"]


for _config, _processor in (
    (Qwen2VLConfig, Qwen2VLImageProcessorOnly),
    (Qwen2_5_VLConfig, Qwen2_5_VLImageProcessorOnly),
    (Qwen3VLConfig, Qwen3VLImageProcessorOnly),
):
    AutoProcessor.register(_config, _processor, exist_ok=True)
