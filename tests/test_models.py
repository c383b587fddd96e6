"""models/ against HF transformers on tiny random checkpoints (fp32, CPU).

Vision embeddings, full-prompt logits, chunked prefill + paged decode, M-RoPE positions
and the loader's error paths, for Qwen2-VL and Qwen2.5-VL.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from triptych.engine.request import MMItem
from triptych.engine.runner.forward_context import (
    AttentionMetadata,
    ForwardContext,
    forward_context,
)
from triptych.kernels import get_ops
from triptych.kernels.cpu.linear import available as cpu_linear_available
from triptych.models import compute_mrope_positions, load_model

IMG, VID, VSTART, VEND = 290, 291, 292, 293
TEXT = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                             "rope_theta": 100.0},
            "bos_token_id": None, "eos_token_id": None, "initializer_range": 0.15}
TOKENS = {"image_token_id": IMG, "video_token_id": VID, "vision_start_token_id": VSTART,
              "vision_end_token_id": VEND}
BLOCK = 4
PATCH_DIM = 3 * 2 * 14 * 14


def hf_config(arch: str, **over):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    if arch == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "initializer_range": 0.15}
        return Qwen2VLConfig(text_config=TEXT, vision_config=vision, **TOKENS, **over)
    # window 56 px = 2 merged tokens; block 1 uses full attention
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "out_hidden_size": 64, "num_heads": 2,
                  "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 4,
                  "initializer_range": 0.15}
    return Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, **TOKENS, **over)


def build_hf(arch: str, **over):
    import transformers

    cls = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration}[arch]
    torch.manual_seed(0)
    model = cls(hf_config(arch, **over)).eval()
    # Random init leaves norms at 1 / biases at 0: perturb them so loading bugs show.
    # (initializer_range 0.15 and rope_theta 100 above make attention far from uniform, so
    # rotary/M-RoPE mistakes move the logits well past the tolerances.)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its save_pretrained checkpoint, checkpoint dir)."""
    hf = build_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, _ = load_model(str(path), torch.float32, "cpu")
    return hf, ours, path


def images(*sizes: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values, image_grid_thw from HF's PIL processor for random images of (w, h)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 64)
    rng = np.random.default_rng(len(sizes))
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    out = proc(images=ims, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def video(t: int, h: int, w: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t * h * w, PATCH_DIM, generator=g), torch.tensor([[t, h, w]])


def prompt(layout: list, seed: int = 0) -> tuple[list[int], list[MMItem], list[int]]:
    """Token ids, items and mm_token_type_ids of a layout like [5, ("image", (1, 4, 6)), 3]."""
    rng = np.random.default_rng(seed)
    ids, items, types = [], [], []
    for part in layout:
        if isinstance(part, int):
            ids += rng.integers(0, 280, part).tolist()
            types += [0] * part
            continue
        modality, grid, *spg = part
        n = grid[0] * grid[1] * grid[2] // 4
        ids.append(VSTART)
        types.append(0)
        items.append(MMItem(modality, f"h{len(items)}", len(ids), n, tuple(grid),
                            second_per_grid_t=spg[0] if spg else None))
        ids += [IMG if modality == "image" else VID] * n
        types += [1 if modality == "image" else 2] * n
        ids.append(VEND)
        types.append(0)
    return ids, items, types


def hf_logits(hf, ids: list[int], types: list[int], **mm) -> torch.Tensor:
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]), **mm)
    return out.logits[0]


class PagedSeq:
    """One sequence's paged KV (non-contiguous blocks) and the metadata of each step."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0) -> None:
        text = model.config.text_config
        shape = (num_blocks, BLOCK, text.num_key_value_heads,
                 text.hidden_size // text.num_attention_heads)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(text.num_hidden_layers)]
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.randperm(num_blocks, generator=g)  # block i of the seq -> id
        self.model = model

    def step(self, embeds: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
        # embeds: [n, hidden] for tokens start..start+n; returns logits [n, vocab]
        n = embeds.shape[0]
        tok = torch.arange(start, start + n)
        nblk = (start + n + BLOCK - 1) // BLOCK
        meta = AttentionMetadata(
            slot_mapping=self.blocks[tok // BLOCK] * BLOCK + tok % BLOCK,
            block_tables=self.blocks[:nblk].to(torch.int32)[None],
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            max_query_len=n)
        with torch.no_grad(), forward_context(ForwardContext(meta, self.kv, get_ops("torch"))):
            hidden = self.model(None, positions, embeds)
        return self.model.compute_logits(hidden)


def our_embeds(model, ids: list[int], items: list[MMItem], pixels: dict) -> torch.Tensor:
    """embed_tokens(ids) with each item's vision rows written at its placeholder."""
    with torch.no_grad():
        emb = model.embed_tokens(torch.tensor(ids))
        for modality, (pv, grid) in pixels.items():
            its = [it for it in items if it.modality == modality]
            for it, e in zip(its, model.encode_images(pv, grid)):
                emb[it.offset:it.end] = e
    return emb


def mrope(model, ids, items):
    vc = model.config.vision_config
    return compute_mrope_positions(len(ids), items, vc.spatial_merge_size,
                                   getattr(vc, "tokens_per_second", None))


# ---------------------------------------------------------------- vision tower

def test_vision_matches_hf(pair):
    hf, ours, _ = pair
    # 112x140 -> grid 8x10 -> merged 4x5: Qwen2.5's 2x2-token windows are uneven at the edges
    pv, grid = images((140, 112), (56, 84), (84, 56))
    with torch.no_grad():
        ref = hf.model.get_image_features(pv, grid).pooler_output
        got = ours.encode_images(pv, grid)
    assert [g.shape for g in got] == [r.shape for r in ref]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    vpv, vgrid = video(3, 4, 8)
    with torch.no_grad():
        (ref,) = hf.model.get_video_features(vpv, vgrid).pooler_output
        (got,) = ours.encode_images(vpv, vgrid)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- full-prompt logits

def full_prompt_case(name: str):
    if name == "text":
        return [17], {}, {}
    if name == "one_image":
        pv, grid = images((84, 56))
        return [5, ("image", grid[0].tolist()), 4], {"image": (pv, grid)}, \
            {"pixel_values": pv, "image_grid_thw": grid}
    if name == "two_images":
        pv, grid = images((140, 112), (56, 84))
        layout = [3, ("image", grid[0].tolist()), 2, ("image", grid[1].tolist()), 4]
        return layout, {"image": (pv, grid)}, {"pixel_values": pv, "image_grid_thw": grid}
    # video with t > 1, then an image; Qwen2.5 spaces frames by tokens_per_second * 0.5.
    # "long_video": more frames (5) than its merged rows and columns (2 x 2): the text after
    # it starts max(h, w) on, not t (transformers 5.24's rule, the one the engine follows)
    vpv, vgrid = video(5, 4, 4) if name == "long_video" else video(3, 4, 6)
    pv, grid = images((56, 56))
    layout = [4, ("video", vgrid[0].tolist(), 0.5), 2, ("image", grid[0].tolist()), 3]
    mm = {"pixel_values_videos": vpv, "video_grid_thw": vgrid, "pixel_values": pv,
              "image_grid_thw": grid, "second_per_grid_ts": torch.tensor([0.5])}
    return layout, {"video": (vpv, vgrid), "image": (pv, grid)}, mm


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "video", "long_video"])
def test_prompt_logits_match_hf(pair, case):
    hf, ours, _ = pair
    layout, pixels, mm = full_prompt_case(case)
    if "second_per_grid_ts" in mm and ours.config.model_type == "qwen2_vl":
        mm.pop("second_per_grid_ts")
        layout[1] = layout[1][:2]
    ids, items, types = prompt(layout)
    ref = hf_logits(hf, ids, types, **mm)
    positions, _ = mrope(ours, ids, items)
    got = PagedSeq(ours).step(our_embeds(ours, ids, items, pixels), positions, 0)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_linear_available(), reason="no oneDNN packed linear in this build")
def test_packed_cpu_linears_match_hf(pair):
    """The engine's CPU path (load_model(cpu_weights="float32")): every linear layer on a
    packed oneDNN weight, the head on its own packed copy; vision and logits still match HF."""
    hf, _, path = pair
    ours, _ = load_model(str(path), torch.float32, "cpu", cpu_weights="float32")
    linears = [m for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear)
               and not n.endswith("lm_head")]
    assert linears and all(hasattr(m, "cpu_gemm") and m.weight.numel() == 0 for m in linears)
    pv, grid = images((140, 112), (56, 84))
    with torch.no_grad():
        ref = hf.model.get_image_features(pv, grid).pooler_output
        got = ours.encode_images(pv, grid)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    layout, pixels, mm = full_prompt_case("two_images")
    ids, items, types = prompt(layout)
    positions, _ = mrope(ours, ids, items)
    logits = PagedSeq(ours).step(our_embeds(ours, ids, items, pixels), positions, 0)
    assert ours._head_gemm is not None  # the head ran packed
    torch.testing.assert_close(logits, hf_logits(hf, ids, types, **mm), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_paged_decode(pair):
    hf, ours, _ = pair
    pv, grid = images((84, 56))
    ids, items, types = prompt([5, ("image", grid[0].tolist()), 4])
    positions, delta = mrope(ours, ids, items)
    emb = our_embeds(ours, ids, items, {"image": (pv, grid)})
    seq = PagedSeq(ours, seed=1)
    cut = items[0].offset + 2  # inside the image placeholder span
    seq.step(emb[:cut], positions[:, :cut], 0)
    logits = seq.step(emb[cut:], positions[:, cut:], cut)[-1]
    mm = {"pixel_values": pv, "image_grid_thw": grid}
    for _ in range(3):
        ref = hf_logits(hf, ids, types, **mm)[-1]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        nxt = int(logits.argmax())
        assert nxt == int(ref.argmax())
        i = len(ids)
        ids, types = ids + [nxt], types + [0]
        with torch.no_grad():
            e = ours.embed_tokens(torch.tensor([nxt]))
        logits = seq.step(e, torch.full((3, 1), i + delta), i)[-1]


# ---------------------------------------------------------------- M-RoPE positions

LAYOUTS = [
    [6],
    [3, ("image", (1, 4, 6)), 5],
    [("image", (1, 8, 4)), 2],
    [2, ("image", (1, 4, 4)), 3, ("image", (1, 6, 10)), 1],
    [4, ("video", (3, 4, 6), 0.5), 3],
    [1, ("video", (2, 4, 4), 1.3), 2, ("image", (1, 2, 8)), 2, ("video", (5, 2, 2)), 1],
    [2, ("video", (4, 2, 2), 2.0)],  # ends inside a video: delta from its temporal ids
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=range(len(LAYOUTS)))
def test_mrope_matches_hf_get_rope_index(pair, layout):
    hf, ours, _ = pair
    ids, items, types = prompt(layout)
    imgs = [it.grid_thw for it in items if it.modality == "image"]
    vids = [it for it in items if it.modality == "video"]
    kw = {"image_grid_thw": torch.tensor(imgs) if imgs else None,
              "video_grid_thw": torch.tensor([v.grid_thw for v in vids]) if vids else None}
    if ours.config.model_type == "qwen2_5_vl" and vids:
        kw["second_per_grid_ts"] = torch.tensor(
            [1.0 if v.second_per_grid_t is None else v.second_per_grid_t for v in vids])
    ref_pos, ref_delta = hf.model.get_rope_index(torch.tensor([ids]), torch.tensor([types]), **kw)
    pos, delta = mrope(ours, ids, items)
    assert torch.equal(pos, ref_pos[:, 0])
    assert delta == int(ref_delta)


# ---------------------------------------------------------------- loader

def test_loader_accepts_transformers5_names_and_shards(pair, tmp_path):
    hf, ours, path = pair
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in sd)  # the in-memory layout
    names = sorted(sd)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / fname))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    other, _ = load_model(str(tmp_path), torch.float32, "cpu")
    mine = dict(ours.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p, mine[name]), name


def test_loader_errors(pair, tmp_path):
    _, _, path = pair
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="FooBarForCausalLM.*Qwen2VLForConditionalGeneration"):
        load_model(str(tmp_path), torch.float32, "cpu")

    from safetensors.torch import load_file
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    gone = "model.layers.1.mlp.up_proj.weight"
    del sd[gone]
    sd["visual.blocks.0.attn.proj.bias"] = torch.zeros(7)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"visual\.blocks\.0\.attn\.proj\.bias.*\(7,\)"):
        load_model(str(tmp_path), torch.float32, "cpu")
    sd.pop("visual.blocks.0.attn.proj.bias")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_tied_embeddings(tmp_path):
    hf = build_hf("qwen2_vl", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    ours, cfg = load_model(str(tmp_path), torch.float32, "cpu")
    assert cfg.tie_word_embeddings and not hasattr(ours, "lm_head")
    ids, items, types = prompt([9])
    positions, _ = mrope(ours, ids, items)
    got = PagedSeq(ours).step(our_embeds(ours, ids, items, {}), positions, 0)
    torch.testing.assert_close(got, hf_logits(hf, ids, types), atol=1e-4, rtol=1e-4)


def test_flat_batch_of_two_sequences(pair):
    """A decode token of one sequence and a prefill chunk of another in one forward."""
    hf, ours, _ = pair
    text = ours.config.text_config
    d = text.hidden_size // text.num_attention_heads
    shape = (32, BLOCK, text.num_key_value_heads, d)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(text.num_hidden_layers)]
    pv, grid = images((56, 84))
    a_ids, a_items, a_types = prompt([6], seed=1)  # text: prefill alone first
    b_ids, b_items, b_types = prompt([3, ("image", grid[0].tolist()), 2], seed=2)
    tables = {"a": [7, 3, 30], "b": [12, 0, 25, 5, 18, 9]}
    a_pos, a_delta = mrope(ours, a_ids, a_items)
    b_pos, _ = mrope(ours, b_ids, b_items)

    def run(chunks):  # chunks: (seq, embeds, positions, start)
        slots, cu, lens, tbl = [], [0], [], []
        for seq, emb, _, start in chunks:
            tok = torch.arange(start, start + emb.shape[0])
            bt = torch.tensor(tables[seq])
            slots.append(bt[tok // BLOCK] * BLOCK + tok % BLOCK)
            cu.append(cu[-1] + emb.shape[0])
            lens.append(start + emb.shape[0])
            tbl.append(bt)
        width = max(len(t) for t in tbl)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            block_tables=torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tbl])
            .to(torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            max_query_len=max(c[1].shape[0] for c in chunks))
        embeds = torch.cat([c[1] for c in chunks])
        positions = torch.cat([c[2] for c in chunks], dim=1)
        with torch.no_grad(), forward_context(ForwardContext(meta, kv, get_ops("torch"))):
            logits = ours.compute_logits(ours(None, positions, embeds))
        return [logits[e - 1] for e in cu[1:]]

    (a_last,) = run([("a", our_embeds(ours, a_ids, a_items, {}), a_pos, 0)])
    nxt = int(a_last.argmax())
    with torch.no_grad():
        a_emb = ours.embed_tokens(torch.tensor([nxt]))
    n = len(a_ids)
    b_emb = our_embeds(ours, b_ids, b_items, {"image": (pv, grid)})
    a_got, b_got = run([("a", a_emb, torch.full((3, 1), n + a_delta), n),
                        ("b", b_emb, b_pos, 0)])
    torch.testing.assert_close(a_got, hf_logits(hf, a_ids + [nxt], a_types + [0])[-1],
                               atol=1e-4, rtol=1e-4)
    ref_b = hf_logits(hf, b_ids, b_types, pixel_values=pv, image_grid_thw=grid)[-1]
    torch.testing.assert_close(b_got, ref_b, atol=1e-4, rtol=1e-4)
