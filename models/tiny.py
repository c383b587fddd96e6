"""`triptych make-tiny`: a real HF-format checkpoint with random weights (any contract's arch).

Tests and demos need checkpoints, and no model hub is reachable: this writes config.json,
model.safetensors (HF's own model class, random init under a seed), a byte-level BPE
tokenizer trained here with `tokenizers` (Qwen2-VL special tokens, ChatML template) and
the image/video processor configs. HF's Auto classes load the directory offline.

Snag: without torchvision, `AutoProcessor.from_pretrained` raises "requires torchvision",
and even `Qwen2VLProcessor(image_processor=..., tokenizer=..., video_processor=None)` fails
(its class check walks the video-processor registry). Choice: no HF processor object;
api/processor.py pairs the tokenizer with `AutoImageProcessor(backend="pil")` (the PIL
processor), expands placeholders as Qwen2VLProcessor does, and preprocesses videos itself
(api/media/video.py) from video_preprocessor_config.json. The tests' oracle
(models/hf_oracle.py ``load_hf_processor``) builds HF's processor class from these files
all the same, without a video processor, so the processor files are written as the hub's
checkpoints write them.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML with Qwen2-VL's vision placeholders; a system turn is added when none is given.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] in ('video', 'video_url') %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# NOTE: token ids of the tiny checkpoints are pinned by tests that count prompt tokens and
# block alignment (test_engine_parity, test_inputs): changing this text shifts them.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe this image in detail. What is written on this page? Transcribe the text.
The invoice total is 42.50 dollars, due on the first of March. Please read the receipt.
In the photo a cat sits on a red chair next to a window; outside it is raining.
Compare the two images and tell me what changed. Count the people in the picture.
Tables, charts and handwritten notes are common in scanned documents and forms.
Hello! How can I help you today? I am a helpful assistant that can see images.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " '
Video frames show a ball rolling across a green field while a dog chases it.
Une phrase en français, eine deutsche Zeile, una frase en español, 日本語のテキスト.
"""


def _train_tokenizer(vocab_size: int, specials: list[str] | None = None,
                     template: str = CHAT_TEMPLATE, named: dict[str, str] | None = None) -> Any:
    """A byte-level BPE trained on the corpus above, plus ``specials`` (default: the
    Qwen vision tokens) as added special tokens, with ``template`` as its chat template.
    ``named``: model-specific special tokens the tokenizer exposes by name (a real
    checkpoint's ``extra_special_tokens``, e.g. InternVL's ``start_image_token``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    lines = [ln.strip() for ln in _CORPUS.strip().splitlines()]
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size - len(SPECIAL_TOKENS), 300),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(lines * 4, trainer)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in specials or SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None,
                                  model_max_length=32768,
                                  **({"extra_special_tokens": named} if named else {}))
    tok.chat_template = template
    return tok


def make_tiny(arch: str, out_dir: str, **kw: Any) -> str:
    """Write a random-weight checkpoint of ``arch`` (a model_type of models/contract.py)
    to ``out_dir`` through its contract's builder; ``kw`` as in ``make_tiny_qwen2_vl``."""
    from triptych.models.contract import contract_for_type

    return contract_for_type(arch).make_tiny(arch, out_dir, **kw)


def edit_json(path: str, drop: tuple[str, ...] = (), **fields: Any) -> None:
    """Rewrite a saved config as the hub's checkpoints write it: ``drop`` keys, set
    ``fields`` (transformers' save_pretrained writes its own spelling of some settings)."""
    with open(path) as f:
        data = {k: v for k, v in json.load(f).items() if k not in drop}
    with open(path, "w") as f:
        json.dump({**data, **fields}, f, indent=2, sort_keys=True)


def save_tokenizer_files(tok: Any, out_dir: str) -> None:
    """The trained tokenizer and its chat template, as a real checkpoint ships them."""
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "chat_template.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template}, f, indent=2)


def make_tiny_qwen2_vl(arch: str, out_dir: str, *, seed: int = 0, hidden_size: int = 64,
              num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
              intermediate_size: int | None = None, vision_depth: int = 2,
              vision_embed_dim: int = 32, vision_heads: int = 2, vocab_size: int = 1024,
              model_vocab_size: int | None = None, init_std: float | None = None,
              max_position_embeddings: int = 8192, tokenizer: Any = None) -> str:
    """Write a random-weight checkpoint of ``arch`` (qwen2_vl | qwen2_5_vl) to ``out_dir``.

    ``vocab_size`` sizes the trained tokenizer; ``model_vocab_size`` (>= it) the embedding,
    as real checkpoints pad their vocab. ``init_std`` defaults to 0.15 for tiny widths so
    different images really change greedy outputs (HF's 0.02 gives near-uniform attention).
    ``tokenizer`` replaces the trained BPE (it must hold SPECIAL_TOKENS; demo/train.py).
    """
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if arch not in ("qwen2_vl", "qwen2_5_vl"):
        raise ValueError(f"unknown arch {arch!r}: use qwen2_vl or qwen2_5_vl")
    head_dim = hidden_size // num_heads
    if head_dim % 4 or hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size / num_heads must be a multiple of 4 and num_heads a "
                         "multiple of num_kv_heads")
    os.makedirs(out_dir, exist_ok=True)
    tok = tokenizer or _train_tokenizer(vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = max(model_vocab_size or 0, len(tok))
    std = init_std if init_std is not None else (0.15 if hidden_size <= 256 else 0.02)
    half = head_dim // 2
    t_sec = half // 4
    section = [t_sec, (half - t_sec) // 2, half - t_sec - (half - t_sec) // 2]
    text = dict(vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=num_layers,
                intermediate_size=intermediate_size or int(hidden_size * 2.6875) // 8 * 8,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                rope_scaling={"type": "mrope", "mrope_section": section},
                rope_theta=10000.0 if hidden_size > 256 else 100.0, initializer_range=std,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True)
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], initializer_range=std,
                  tie_word_embeddings=True, bos_token_id=ids["<|endoftext|>"],
                  eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    if arch == "qwen2_vl":
        vision = dict(depth=vision_depth, embed_dim=vision_embed_dim, hidden_size=hidden_size,
                      num_heads=vision_heads, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, initializer_range=std)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        cls = transformers.Qwen2VLForConditionalGeneration
    else:
        # The last block of each half attends fully, the others use windows (real 2.5
        # checkpoints: every 8th of 32); depth 2 -> [1], so window attention is exercised.
        full = [i for i in range(vision_depth) if (i + 1) % max(vision_depth // 2, 2) == 0]
        vision = dict(depth=vision_depth, hidden_size=vision_embed_dim,
                      intermediate_size=vision_embed_dim * 2, out_hidden_size=hidden_size,
                      num_heads=vision_heads, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=full,
                      tokens_per_second=2, initializer_range=std)
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    cfg.architectures = [cls.__name__]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer_files(tok, out_dir)
    # 224x224 images keep their size (256 patches); tiny ones are resized up to 56x56. Written
    # as the hub's Qwen2-VL / Qwen2.5-VL files are: min_pixels (the hub's 3136) and max_pixels
    # (the hub's 16384 cells of 28 x 28 scaled down to 256) at the top level, no "size".
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=256 * 28 * 28).save_pretrained(out_dir)
    edit_json(os.path.join(out_dir, "preprocessor_config.json"), drop=("size",),
              min_pixels=56 * 56, max_pixels=256 * 28 * 28,
              processor_class="Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor")
    with open(os.path.join(out_dir, "video_preprocessor_config.json"), "w") as f:
        json.dump({"min_pixels": 56 * 56, "max_pixels": 64 * 28 * 28, "fps": 2.0,
                   "max_frames": 16, "temporal_patch_size": 2, "patch_size": 14,
                   "merge_size": 2}, f, indent=2)
    return out_dir


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "make-tiny", help="write a tiny random HF-format checkpoint (tests, demos)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Write a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL checkpoint with random "
                    "weights, a locally trained BPE tokenizer and processor configs. Nothing "
                    "is downloaded.")
    from triptych.models.contract import contract_names

    p.add_argument("--arch", choices=contract_names(), default="qwen2_vl",
                   help="architecture (a model_type)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--hidden-size", type=int, default=64, help="language model width")
    p.add_argument("--num-layers", type=int, default=2, help="language model layers")
    p.add_argument("--num-heads", type=int, default=4, help="attention heads")
    p.add_argument("--num-kv-heads", type=int, default=2, help="KV heads (GQA)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width (default ~2.7x hidden)")
    p.add_argument("--vision-depth", type=int, default=2, help="vision tower blocks")
    p.add_argument("--vision-embed-dim", type=int, default=32, help="vision tower width")
    p.add_argument("--vision-heads", type=int, default=2, help="vision attention heads")
    p.add_argument("--vocab-size", type=int, default=1024, help="trained tokenizer vocabulary")
    p.add_argument("--model-vocab-size", type=int, default=None,
                   help="embedding rows (>= tokenizer vocab; e.g. 151936 like real Qwen2-VL)")
    p.add_argument("--init-std", type=float, default=None,
                   help="weight init std (default 0.15 up to hidden 256, else 0.02)")


def run(args: argparse.Namespace) -> int:
    out = make_tiny(args.arch, args.out, seed=args.seed, hidden_size=args.hidden_size,
                    num_layers=args.num_layers, num_heads=args.num_heads,
                    num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
                    vision_depth=args.vision_depth, vision_embed_dim=args.vision_embed_dim,
                    vision_heads=args.vision_heads, vocab_size=args.vocab_size,
                    model_vocab_size=args.model_vocab_size, init_std=args.init_std)
    print(f"wrote {out}")
    return 0
