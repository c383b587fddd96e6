"""InternVL (HF format) under the model contract (models/contract.py).

What differs from the Qwen defaults: 1-D positions (the same id on all three rows, delta
0); an image is its tiles, wrapped as ``<img>`` + ``<IMG_CONTEXT>`` x N + ``</img>`` (the
template writes one ``<IMG_CONTEXT>``, the processor glue expands it and adds the
wrappers); the image processor is GotOcr2's, always with dynamic crops (a grid of tiles of
the aspect ratio nearest the image's, within min/max_patches, plus a thumbnail when there
is more than one), whose tiling settings go into every image's key. Images only; under TP
only the language model is sharded.
"""
from __future__ import annotations

from typing import Any

import torch
from triptych.models.contract import ModelContract

# NOTE: HF's InternVLProcessor passes crop_to_patches=True to the image processor on every
# call, while the hub's InternVL-HF checkpoints store "crop_to_patches": false in
# preprocessor_config.json. HF's processor is the reference, so the crop is always on, and
# the key records this value, not the file's.
CROP_TO_PATCHES = True


def _patch(hf: Any) -> int:
    p = hf.vision_config.patch_size
    return p[0] if isinstance(p, (list, tuple)) else p


class InternVLContract(ModelContract):
    architectures = ("InternVLForConditionalGeneration",)
    model_types = ("internvl",)
    modalities = ("image",)
    # TP shards the language model; the tower (HF's InternViT module) stays whole on every
    # rank: in "weights" mode each rank encodes every image, in "data" mode its share
    shards_vision_weights = False
    placeholder_tokens = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")

    def head_dim(self, text: Any) -> int:
        if text.model_type == "qwen3":  # Qwen3 states its own head_dim
            return int(text.head_dim)
        return text.hidden_size // text.num_attention_heads

    def spatial_merge_size(self, hf: Any) -> int:
        return round(1 / hf.downsample_ratio)

    def check(self, hf: Any) -> None:
        if hf.vision_feature_layer != -1:
            raise ValueError(f"InternVL vision_feature_layer {hf.vision_feature_layer} is not "
                             "supported (only -1, the last layer)")
        text = self.text_config(hf)
        if text.model_type not in ("qwen2", "qwen3"):
            raise ValueError(f"InternVL with a {text.model_type!r} decoder is not supported "
                             "(only qwen2 and qwen3)")
        r = round(1 / hf.downsample_ratio)
        if abs(r * hf.downsample_ratio - 1) > 1e-6:
            raise ValueError(f"downsample_ratio {hf.downsample_ratio} must be 1 / an integer")

    def positions(self, num_tokens: int, items: list[Any], hf: Any
                  ) -> tuple[torch.Tensor, int]:
        return torch.arange(num_tokens).expand(3, -1).clone(), 0

    def span_wrappers(self, tokenizer: Any) -> tuple[list[int], list[int]]:
        return ([tokenizer.convert_tokens_to_ids("<img>")],
                [tokenizer.convert_tokens_to_ids("</img>")])

    def image_hash_kwargs(self, ip: Any) -> dict[str, Any]:
        return {"class": type(ip).__name__, "size": dict(ip.size),
                "crop_to_patches": CROP_TO_PATCHES, "min_patches": ip.min_patches,
                "max_patches": ip.max_patches, "mean": list(ip.image_mean),
                "std": list(ip.image_std), "rescale": ip.rescale_factor,
                "resample": int(ip.resample),
                **{f: getattr(ip, f, None) for f in ("do_resize", "do_rescale",
                                                     "do_normalize", "do_convert_rgb")}}

    def preprocess_image(self, ip: Any, img: Any, hf: Any, preprocessor: str = "fast",
                         out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The tiles of one image, patchified (models/internvl_image.py on the fast path)."""
        from triptych.models import image_ops, internvl_image
        from triptych.models.contract import _into, use_fast
        from triptych.models.internvl import patchify

        p = _patch(hf)
        if use_fast(preprocessor, ip, internvl_image.unsupported):
            return internvl_image.preprocess(ip, image_ops.rgb_array(img), p, CROP_TO_PATCHES,
                                             out)
        tiles = ip(images=[image_ops.as_pil(img)], crop_to_patches=CROP_TO_PATCHES,
                   return_tensors="pt")["pixel_values"]
        g = tiles.shape[-1] // p
        return _into(out, patchify(tiles, p)), (int(tiles.shape[0]), g, g)

    def pixel_shape(self, ip: Any, hf: Any, height: int, width: int) -> tuple[int, int]:
        from triptych.models import internvl_image

        return internvl_image.pixel_shape(ip, height, width, _patch(hf), CROP_TO_PATCHES)

    def hf_media_inputs(self, items: list[Any]) -> dict[str, Any] | None:
        from triptych.models.internvl import unpatchify

        if not items:
            return {}
        patch = round((items[0].pixel_values.shape[1] // 3) ** 0.5)
        return {"pixel_values": torch.cat([unpatchify(it.pixel_values, it.grid_thw[0],
                                                      it.grid_thw[1], patch) for it in items])}

    def model_class(self) -> type:
        from triptych.models.internvl import InternVLForCausalLM

        return InternVLForCausalLM

    def make_tiny(self, arch: str, out_dir: str, **kw: Any) -> str:
        from triptych.models.tiny_internvl import make_tiny_internvl

        return make_tiny_internvl(out_dir, **kw)
