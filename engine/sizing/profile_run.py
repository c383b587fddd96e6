"""The profile run: one step at the limits, to measure the memory a worker needs besides its
KV cache (engine/sizing/memory.py does the arithmetic). vLLM v1's ``profile_run``, on our runner:

    request 0       the largest image the limits allow, then one text token; the step
                    computes as much of it as the budget leaves (the tower runs over the
                    whole image whatever the chunk)
    request 1       a text prompt asking for prompt_logprobs, as long a chunk as the
                    scheduler gives one (PROMPT_LOGPROBS_CHUNK): its [chunk, vocab] fp32
                    logits and their log-softmax, the largest logits a step makes
    requests 2..S-1 text prompts sharing the rest of max_num_batched_tokens, each ending in
                    this step, so S rows of logits reach the sampler (temperature, top-k,
                    top-p, seeds and logprobs: its largest path)

    S = min(max_num_seqs, max_num_batched_tokens); blocks come from a small cache
    (``profile_blocks``) that the real one replaces afterwards.

A worker without the tower (an LM worker of a layout with an encode pool) profiles text
only; an encode worker runs the tower alone (``run_encoder_profile``). Nothing the profile
does stays behind: its embeddings never enter the encoder cache, its seeded generators are
forgotten, and its batch rows leave at the next step (their ids are not request ids).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from triptych.engine.encoder.encoder_cache import EncoderCache
from triptych.engine.request import MMItem, Request
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.engine.scheduler import PROMPT_LOGPROBS_CHUNK, SchedulerOutput
from triptych.engine.sizing.memory import MemorySnapshot, Usage, usage_after_profile

PROFILE_ID = "~profile-"  # never a request id of the router or LLM
MAX_IMAGE_PIXELS = 32_000_000  # api/media/limits.py's max_image_pixels: larger is refused
ASPECTS = (1.0, 0.75)  # width / height tried (0.75: a 3 x 4 tiling, InternVL's largest)


def max_image_tokens(config: Any, max_model_len: int) -> int:
    """Placeholder rows one image may take: the prompt holds it plus a text token and leaves
    room for one output token; without chunked prefill the prompt fits one step."""
    cap = max_model_len - 2
    if not config.enable_chunked_prefill:
        cap = min(cap, config.max_num_batched_tokens - 1)
    return cap


def largest_image(model_dir: str, hf: Any, max_tokens: int) -> MMItem | None:
    """The image with the most placeholder rows (at most ``max_tokens``) that the
    checkpoint's own HF processor makes from an image of at most MAX_IMAGE_PIXELS pixels.

    The processor is asked, not modelled: a small probe gives pixels per row, then each
    aspect is tried at the size that would fill ``max_tokens`` (shrunk until it fits; a
    processor that caps the pixels simply gives fewer rows)."""
    from PIL import Image
    from transformers import AutoImageProcessor
    from triptych.models.contract import contract_for

    contract = contract_for(hf)
    if "image" not in contract.modalities or max_tokens < 1:
        return None
    ip = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")
    merge = contract.spatial_merge_size(hf)

    def make(w: int, h: int) -> tuple[torch.Tensor, tuple[int, int, int], int]:
        pixels, grid = contract.preprocess_image(ip, Image.new("RGB", (w, h), (127, 96, 64)),
                                                 hf)
        return pixels, grid, math.prod(grid) // merge ** 2

    _, _, rows = make(448, 448)
    per_row = 448 * 448 / max(rows, 1)
    best: tuple[torch.Tensor, tuple[int, int, int], int] | None = None
    for aspect in ASPECTS:
        area = min(MAX_IMAGE_PIXELS, max_tokens * per_row)
        for _ in range(8):
            w = max(28, int(math.sqrt(area * aspect)))
            h = max(28, int(w / aspect))
            got = make(w, h)
            if got[2] <= max_tokens:
                if best is None or got[2] > best[2]:
                    best = got
                break
            area *= 0.97 * max_tokens / got[2]
    if best is None:
        return None
    pixels, grid, rows = best
    return MMItem("image", PROFILE_ID + "image", 0, rows, grid, pixel_values=pixels)


def profile_step(config: Any, shape: Any, hf: Any, max_model_len: int,
                 image: MMItem | None) -> SchedulerOutput:
    """The profile step's requests and their blocks (ids 0.. of the profile cache)."""
    from triptych.models.contract import contract_for

    contract = contract_for(hf)
    budget = config.max_num_batched_tokens
    seqs = max(1, min(config.max_num_seqs, budget))
    text = next(t for t in range(3) if t not in (shape.image_token_id, shape.video_token_id))
    prompts: list[tuple[list[int], list[MMItem], int]] = []  # (ids, items, tokens this step)
    if image is not None:
        ids = [shape.image_token_id] * image.length + [text]
        prompts.append((ids, [image], min(len(ids), budget - (seqs - 1))))
        budget -= prompts[0][2]
        seqs -= 1
    plp = min(PROMPT_LOGPROBS_CHUNK, budget - (seqs - 1), max_model_len - 2)
    with_plp = len(prompts) if seqs > 1 and plp > 0 else -1  # its index in ``prompts``
    if with_plp >= 0:  # (one more token than the chunk: every position is scored)
        prompts.append(([text] * (plp + 1), [], plp))
        budget -= plp
        seqs -= 1
    for i in range(seqs):
        n = min(budget // seqs + (i < budget % seqs), max_model_len - 2)
        if n > 0:
            prompts.append(([text] * n, [], n))
    out = SchedulerOutput([], 0)
    next_block = 0
    for i, (ids, items, n) in enumerate(prompts):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=i, logprobs=5,
                                max_tokens=1, prompt_logprobs=5 if i == with_plp else None)
        positions, delta = contract.positions(len(ids), items, hf)
        req = Request(f"{PROFILE_ID}{i}", ids, params, items, mrope_positions=positions,
                      mrope_delta=delta)
        req.num_computed_tokens = n  # (as the scheduler counts a scheduled step)
        blocks = -(-n // config.block_size)
        out.scheduled.append((req, n))
        out.block_ids[req.request_id] = list(range(next_block, next_block + blocks))
        next_block += blocks
    out.num_scheduled_tokens = sum(n for _, n in out.scheduled)
    return out


def profile_blocks(config: Any) -> int:
    """Blocks the profile step uses at most: its tokens, plus one partial block per request."""
    seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens))
    return -(-config.max_num_batched_tokens // config.block_size) + seqs + 1


@contextlib.contextmanager
def _no_encoder_cache(encoder: Any) -> Iterator[None]:
    """Inside the block the encoder keeps no embedding (the profile's image is nobody's)."""
    if encoder is None:
        yield
        return
    saved = encoder.cache, encoder.num_items_encoded
    encoder.cache = EncoderCache(0)
    try:
        yield
    finally:
        encoder.cache, encoder.num_items_encoded = saved


def run_profile(runner: Any, step: SchedulerOutput) -> None:
    """One ``runner.execute`` of the profile step; what it left in the sampler is dropped."""
    with _no_encoder_cache(runner.encoder):
        runner.execute(step)
    for req, _ in step.scheduled:
        runner.sampler.forget(req.request_id)


@torch.inference_mode()
def run_encoder_profile(encoder: Any, image: MMItem) -> None:
    """The vision tower over the largest image (an encode worker's profile run)."""
    with _no_encoder_cache(encoder):
        encoder.get_embeddings([image])


class ProfileMeter:
    """A worker's (or rank's) CUDA measurements for sizing its KV cache: the device at start,
    the weights, and torch's peak over the profile run (``begin`` .. ``usage``)."""

    def __init__(self, device: torch.device, start: MemorySnapshot) -> None:
        self.device, self.start = device, start
        self.weights = self.before = 0

    def loaded(self) -> None:
        """The model is built: what torch holds now, beyond the start, is its weights."""
        self.weights = torch.cuda.memory_allocated(self.device) - self.start.torch_allocated

    def begin(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.before = torch.cuda.memory_allocated(self.device)

    def usage(self, encoder_cache: int = 0) -> Usage:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return usage_after_profile(self.start, self.weights, self.before, peak,
                                   MemorySnapshot.take(self.device), encoder_cache)
