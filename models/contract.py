"""The model contract: what the engine asks of a model, and which contract serves a checkpoint.

Everything outside ``models/`` (the runner, the encode worker, the embedding transfer, the
processor glue, ``make-tiny``) reaches a model through a ``ModelContract`` and the module it
builds; nothing there names an architecture. Adding a model = one contract (a subclass
below), its module, its tiny-checkpoint builder and its parity tests, plus one line in
``_CONTRACTS``.

    contract (per architecture, no weights)        module (built by ``build``)
    -------------------------------------------    ---------------------------------------
    architectures / model_types                    encode_images(pixels, grid) -> payloads
    head_dim(text config)                          embed_tokens(ids) -> [T, hidden]
    payload_width(hf): columns of one item's        merge_vision(embeds, spans) -> extra kw
        encoder payload (embeddings | extras)      forward(ids, positions, embeds, **extra)
    positions(num_tokens, items, hf) -> (pos, d)   compute_logits(hidden)
    modalities, check(hf): one-line refusals       load_weights(named tensors) -> loaded
    build(...): the module (TP plan applied)       shard_table(), spatial_merge_size
    make_tiny(arch, out_dir, ...)
    processor glue: image_hash_kwargs, preprocess_image (the --mm-preprocessor fast path or
        HF's processor), spatial_merge_size, span_wrappers, placeholder_tokens;
        hf_media_inputs (the HF oracle's kwargs)

The encoder payload is ONE 2-D tensor per item, ``[rows, payload_width]``: the embedding
columns first, then whatever else the language model consumes per placeholder row (e.g.
Qwen3-VL's DeepStack features, one ``hidden`` block per injected layer). One tensor means
the encoder cache counts all of it in its byte bound, the connector moves it as one frame
whose shape the receiver checks, and a chunk of a prefill that covers rows [a, b) of an
image simply takes rows [a, b) of the payload: nothing can be split inconsistently.
"""
from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("triptych.models")

# model_type -> (module, contract class); imported lazily so a process loads one model's code
_CONTRACTS: dict[str, tuple[str, str]] = {
    "qwen2_vl": ("triptych.models.qwen2_vl_contract", "Qwen2VLContract"),
    "qwen2_5_vl": ("triptych.models.qwen2_vl_contract", "Qwen2VLContract"),
    "qwen3_vl": ("triptych.models.qwen3_vl_contract", "Qwen3VLContract"),
    "qwen3_vl_moe": ("triptych.models.qwen3_vl_contract", "Qwen3VLMoeContract"),
    "internvl": ("triptych.models.internvl_contract", "InternVLContract"),
}


class ModelContract:
    """One architecture family as the engine sees it. Subclasses override what differs;
    the defaults describe a Qwen-style VLM (M-RoPE over (t, h, w), one embedding per row)."""

    architectures: tuple[str, ...] = ()  # HF ``architectures`` entries served
    model_types: tuple[str, ...] = ()  # HF ``model_type`` values served (= make-tiny --arch)
    modalities: tuple[str, ...] = ("image", "video")  # what the processor may send
    supports_tensor_parallel = True
    supports_encoder_data_parallel = True  # the tower encodes any subset of items alone
    shards_vision_weights = True  # False: the tower stays whole on every rank under TP
    # True (Qwen3-VL): a video is laid out as HF's Qwen3VLProcessor does, one span per
    # temporal group after its "<t seconds>" text; the processor sends each group as its
    # own video item of grid (1, h, w), so positions and the encoder need nothing new
    video_timestamps = False

    # -- what the engine derives from the config ------------------------------------------
    def text_config(self, hf: Any) -> Any:
        return getattr(hf, "text_config", None) or hf

    def head_dim(self, text: Any) -> int:
        """The language model's attention head size (attention, rotary tables, KV cache)."""
        return text.hidden_size // text.num_attention_heads

    def payload_width(self, hf: Any) -> int:
        """Columns of one item's encoder payload (default: just the embedding)."""
        return self.text_config(hf).hidden_size

    def check(self, hf: Any) -> None:
        """Refuse a config this contract cannot serve (ValueError, one line)."""

    def positions(self, num_tokens: int, items: list[Any], hf: Any
                  ) -> tuple[torch.Tensor, int]:
        """Rotary position ids ``[3, num_tokens]`` of a prompt and its decode delta."""
        from triptych.models.mrope import compute_mrope_positions

        vision = hf.vision_config
        return compute_mrope_positions(num_tokens, items, vision.spatial_merge_size,
                                       getattr(vision, "tokens_per_second", None))

    # -- the processor glue (api/processor.py) --------------------------------------------
    # placeholder-ish tokens a client's text may not carry
    placeholder_tokens: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>",
                                           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")

    def spatial_merge_size(self, hf: Any) -> int:
        """Patches per placeholder row along each axis (rows = t * h * w / merge**2)."""
        return hf.vision_config.spatial_merge_size

    def span_wrappers(self, tokenizer: Any) -> tuple[list[int], list[int]]:
        """Token ids the processor puts before / after each expanded placeholder span
        (Qwen's template writes its own vision_start / vision_end: none)."""
        return [], []

    def image_hash_kwargs(self, ip: Any) -> dict[str, Any]:
        """Every image-processor setting that changes an image's pixels (its cache key)."""
        return {"class": type(ip).__name__, "patch": ip.patch_size, "merge": ip.merge_size,
                "tps": ip.temporal_patch_size, "mean": list(ip.image_mean),
                "std": list(ip.image_std), "rescale": ip.rescale_factor,
                "resample": int(ip.resample), "size": dict(ip.size),
                **{f: getattr(ip, f, None) for f in ("do_resize", "do_rescale",
                                                     "do_normalize", "do_convert_rgb")}}

    def preprocess_image(self, ip: Any, img: Any, hf: Any, preprocessor: str = "fast",
                         out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One 8-bit RGB image (PIL, or [H, W, 3] uint8) -> (flat patches [t*h*w, ...], grid
        (t, h, w)). ``preprocessor`` (``--mm-preprocessor``): "fast" (models/qwen_vl_image.py:
        HF's values, bit for bit, at a fraction of the cost) where it can follow ``ip``, else
        "hf" (HF's image processor ``ip`` itself). ``out``: a float32 tensor of
        ``pixel_shape`` to write the values into (the fast path writes nowhere else)."""
        from triptych.models import image_ops, qwen_vl_image

        if use_fast(preprocessor, ip, qwen_vl_image.unsupported):
            return qwen_vl_image.preprocess(ip, image_ops.rgb_array(img), out)
        res = ip(images=[image_ops.as_pil(img)], return_tensors="pt")
        return (_into(out, res["pixel_values"]),
                tuple(int(x) for x in res["image_grid_thw"][0]))

    def pixel_shape(self, ip: Any, hf: Any, height: int, width: int) -> tuple[int, int]:
        """[rows, columns] of the pixel values ``preprocess_image`` makes of a ``width`` x
        ``height`` image (to size its ``out`` before the work)."""
        from triptych.models import qwen_vl_image

        return qwen_vl_image.pixel_shape(ip, height, width)

    def hf_media_inputs(self, items: list[Any]) -> dict[str, Any] | None:
        """HF's own class's media kwargs for these items (the oracle, the bench peer), or
        None for Qwen-VL's form (pixel_values + grids + mm_token_type_ids)."""
        return None

    # -- the module -------------------------------------------------------------------------
    def model_class(self) -> type:
        raise NotImplementedError

    def build(self, hf: Any, dtype: torch.dtype, device: str, attention_backend: str,
              tp: Any = None, shard_vision: bool = True, parts: str = "all") -> Any:
        """The module on ``device`` with garbage weights (``load_weights`` fills them); with
        ``tp``, this rank's shard (the contract's TP plan applied on the meta device);
        ``parts``: all | vision | language (models/weight_parts.py)."""
        self.check(hf)
        extra: dict[str, Any] = {} if tp is None else {"tp": tp, "shard_vision": shard_vision}
        if parts != "all":
            extra["parts"] = parts
        return self.model_class()(hf, dtype=dtype, device=device,
                                  attention_backend=attention_backend, **extra)

    # -- checkpoints --------------------------------------------------------------------------
    def make_tiny(self, arch: str, out_dir: str, **kw: Any) -> str:
        """Write a tiny random HF-format checkpoint of ``arch`` (tests, demos)."""
        raise NotImplementedError

    def hf_class_name(self, hf: Any) -> str:
        """HF transformers' class of this checkpoint (the oracle)."""
        return (hf.architectures or self.architectures)[0]


PREPROCESSORS = ("fast", "hf")  # --mm-preprocessor


def _into(out: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """HF's path's values, copied into the caller's ``out`` when there is one."""
    if out is None:
        return values
    from triptych.models.image_ops import output

    return output(out, tuple(values.shape)).copy_(values)


def use_fast(preprocessor: str, ip: Any, unsupported: Callable[[Any], str | None]) -> bool:
    """Whether ``preprocess_image`` takes the fast path: asked for and able to follow
    ``ip`` (``unsupported(ip)``: why not; logged once per processor class and reason)."""
    if preprocessor not in PREPROCESSORS:
        raise ValueError(f"mm_preprocessor must be one of {', '.join(PREPROCESSORS)}, "
                         f"got {preprocessor!r}")
    if preprocessor == "hf":
        return False
    why_not = unsupported(ip)
    if why_not is not None:
        _log_fallback(type(ip).__name__, why_not)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _log_fallback(processor: str, reason: str) -> None:
    logger.warning("fast image preprocessing cannot follow %s (%s): HF's processor runs "
                   "instead", processor, reason)


def write_vision_rows(embeds: torch.Tensor, spans: list[tuple[int, torch.Tensor]]) -> None:
    """Overwrite placeholder rows of the flat batch with the payloads' embedding columns
    (the first ``hidden`` of each payload row; extras are the model's business)."""
    from triptych.engine.device.device_io import to_device

    hidden = embeds.shape[1]
    for row, payload in spans:  # (payloads received from the encode pool are on the host)
        embeds[row:row + payload.shape[0]] = to_device(payload[:, :hidden],
                                                       embeds.device).to(embeds.dtype)


def contract_names() -> list[str]:
    """Every model_type served (also the ``make-tiny --arch`` choices)."""
    return sorted(_CONTRACTS)


def supported_architectures() -> list[str]:
    return sorted({a for t in _CONTRACTS for a in _load(t).architectures})


def _load(model_type: str) -> ModelContract:
    module, cls = _CONTRACTS[model_type]
    return getattr(importlib.import_module(module), cls)()


def contract_for_type(model_type: str) -> ModelContract:
    """The contract of a ``model_type`` (a make-tiny arch); ValueError when none."""
    if model_type not in _CONTRACTS:
        raise ValueError(f"unknown arch {model_type!r}: use one of "
                         f"{', '.join(contract_names())}")
    return _load(model_type)


def contract_for(hf: Any) -> ModelContract:
    """The contract serving an HF config: its ``architectures`` must name one we serve
    (ValueError otherwise, listing what is supported)."""
    archs = list(getattr(hf, "architectures", None) or [])
    model_type = getattr(hf, "model_type", None)
    if model_type in _CONTRACTS:
        c = _load(model_type)
        if not archs or any(a in c.architectures for a in archs):
            return c
    raise ValueError(f"unsupported model architecture {archs or model_type!r}; "
                     f"supported: {', '.join(supported_architectures())}")
