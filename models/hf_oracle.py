"""HF transformers' own processor and model on a checkpoint: the correctness oracle.

Two ways in:

- ``hf_chat_greedy``: the oracle. HF end to end, as a user of transformers runs it: HF's
  processor class for the checkpoint on the raw messages and images (its chat template,
  its image processor, its placeholder expansion), then HF's ``generate``. Nothing of
  triptych's preprocessing reaches it, so a prompt or a pixel triptych makes differently
  shows up as a different prompt or different tokens.
- ``hf_greedy`` / ``hf_inputs``: HF's model on triptych's processed prompts (same token
  ids, same pixel values): model-side parity only, and the bench's HF peer. A test that
  uses them checks the engine against HF's model, never the preprocessing.
"""
from __future__ import annotations

from typing import Any

import torch
from triptych.models.contract import contract_for


def load_hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    import transformers
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    arch = (cfg.architectures or ["Qwen2VLForConditionalGeneration"])[0]
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=dtype,
                                                        local_files_only=True)
    return model.eval()


def load_hf_processor(model_dir: str) -> Any:
    """HF's processor for the checkpoint: the class ``AutoProcessor`` picks for its config,
    made from the checkpoint's own files (processor_config.json, tokenizer, image processor).

    NOTE: without torchvision ``AutoProcessor`` cannot load (every video processor needs
    it, and the processor's class check fails on a missing one), and this project's
    machines have none (PyPI's wheels are built for CUDA torch). So the video processor is
    AutoVideoProcessor's where torchvision imports, else absent: ``videos=`` then raises.
    The image processor is HF's PIL one either way, as triptych's: HF's two backends
    resize with different rounding, and the oracle is about prompts and tokens.
    """
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    cls = PROCESSOR_MAPPING[type(AutoConfig.from_pretrained(model_dir, local_files_only=True))]
    parts = {"image_processor": AutoImageProcessor.from_pretrained(
                 model_dir, local_files_only=True, backend="pil"),
             "tokenizer": AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
             "video_processor": _video_processor(model_dir)}
    processor_dict, kwargs = cls.get_processor_dict(model_dir, local_files_only=True)

    class Processor(cls):  # HF's class; only its check of a missing video processor eased
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    return Processor.from_args_and_dict([parts[a] for a in cls.get_attributes()],
                                        processor_dict, **kwargs)


def _video_processor(model_dir: str) -> Any:
    try:
        import torchvision  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # absent, or built for another torch
        return None
    from transformers import AutoVideoProcessor

    return AutoVideoProcessor.from_pretrained(model_dir, local_files_only=True)


def hf_chat_inputs(processor: Any, messages: list[dict]) -> dict[str, torch.Tensor]:
    """HF's processor on raw chat messages (HF's form: ``{"type": "image", "image": PIL}``,
    ``{"type": "video", "video": frames}``): its chat template, media and expansion."""
    return dict(processor.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=True,
                                              return_tensors="pt"))


@torch.inference_mode()
def hf_chat_greedy(model: Any, processor: Any, messages: list[dict], max_new_tokens: int,
                   top_logprobs: int = 5) -> tuple[list[int], list[int], list[dict[int, float]]]:
    """HF end to end: (prompt ids, greedy ids with EOS ignored, top logprobs per step)."""
    inp = hf_chat_inputs(processor, messages)
    no_eos(model)
    out = model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True,
                         pad_token_id=processor.tokenizer.pad_token_id)
    prompt = inp["input_ids"][0].tolist()
    return prompt, out.sequences[0, len(prompt):].tolist(), _tops(out.logits, top_logprobs)


def _tops(logits: tuple[torch.Tensor, ...], k: int) -> list[dict[int, float]]:
    tops = []
    for step_logits in logits:
        v, i = torch.log_softmax(step_logits[0].float(), -1).topk(k)
        tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
    return tops


def no_eos(model: Any) -> None:
    """Generate exactly max_new_tokens. (min_new_tokens would instead mask EOS out of the
    logits and change greedy picks; triptych's ignore_eos only ignores the stop.)"""
    model.generation_config.eos_token_id = None


def hf_inputs(prompts: list[Any], pad_token_id: int, hf_config: Any = None
              ) -> dict[str, torch.Tensor]:
    """Left-padded batch of processed prompts (``.prompt_token_ids``, ``.mm_items``); the
    media kwargs in the form the checkpoint's HF class takes (its contract's, when
    ``hf_config`` is given; Qwen-VL's otherwise)."""
    L = max(len(p.prompt_token_ids) for p in prompts)
    ids = torch.full((len(prompts), L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    types = torch.zeros((len(prompts), L), dtype=torch.int32)  # 0 text, 1 image, 2 video
    for i, p in enumerate(prompts):
        pad = L - len(p.prompt_token_ids)
        ids[i, pad:] = torch.tensor(p.prompt_token_ids)
        mask[i, pad:] = 1
        for it in p.mm_items:
            types[i, pad + it.offset:pad + it.end] = 1 if it.modality == "image" else 2
    out: dict[str, Any] = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=types)
    items = [it for p in prompts for it in p.mm_items]
    if hf_config is not None:
        media = contract_for(hf_config).hf_media_inputs(items)
        if media is not None:  # the class takes no token types
            del out["mm_token_type_ids"]
            return {**out, **media}
    imgs = [it for it in items if it.modality == "image"]
    vids = [it for it in items if it.modality == "video"]
    if imgs:
        out["pixel_values"] = torch.cat([it.pixel_values for it in imgs])
        out["image_grid_thw"] = torch.tensor([it.grid_thw for it in imgs])
    timed = hf_config is not None and contract_for(hf_config).video_timestamps
    if vids:
        out["pixel_values_videos"] = torch.cat([it.pixel_values for it in vids])
        out["video_grid_thw"] = torch.tensor(_video_grids(vids) if timed
                                             else [it.grid_thw for it in vids])
        if not timed and any(it.second_per_grid_t is not None for it in vids):
            out["second_per_grid_ts"] = torch.tensor([it.second_per_grid_t or 1.0 for it in vids])
    return out


def _video_grids(vids: list[Any]) -> list[tuple[int, int, int]]:
    """Qwen3-VL: the processor sends each temporal group of a video as its own item (key
    ``<video key>#t<g>``); HF's processor gives the clip as one grid (t, h, w)."""
    grids: list[tuple[int, int, int]] = []
    for it in vids:
        if grids and not it.mm_hash.endswith("#t0"):  # the next group of the same clip
            t, h, w = grids[-1]
            grids[-1] = (t + it.grid_thw[0], h, w)
        else:
            grids.append(tuple(it.grid_thw))
    return grids


@torch.inference_mode()
def hf_greedy(model: Any, prompt: Any, max_new_tokens: int, pad_token_id: int = 0,
              top_logprobs: int = 5) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens of one processed prompt (EOS ignored) and the top logprobs at each
    step: HF's model on triptych's inputs (model-side parity; see the module docstring)."""
    inp = hf_inputs([prompt], pad_token_id, model.config)
    no_eos(model)
    out = model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True,
                         pad_token_id=pad_token_id)
    return out.sequences[0, inp["input_ids"].shape[1]:].tolist(), _tops(out.logits, top_logprobs)
