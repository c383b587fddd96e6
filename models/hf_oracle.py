"""HF transformers' own model on a checkpoint: the correctness oracle and the bench peer.

Inputs are built from triptych's processed prompts (same token ids, same pixel values),
so a mismatch can only come from the model/engine side.
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
    """Greedy tokens of one prompt (EOS ignored) and the top logprobs at each step."""
    inp = hf_inputs([prompt], pad_token_id, model.config)
    no_eos(model)
    out = model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=pad_token_id)
    tokens = out.sequences[0, inp["input_ids"].shape[1]:].tolist()
    tops = []
    for step_logits in out.logits:
        lp = torch.log_softmax(step_logits[0].float(), -1)
        v, i = lp.topk(top_logprobs)
        tops.append(dict(zip(i.tolist(), v.tolist())))
    return tokens, tops
