#!/usr/bin/env python3
"""Make tests/fixtures/qwen35-vl-tiny: a tiny random-weight Qwen3.5 WITH its vision tower, and its references.

Everything numeric comes from tools nobody on this project wrote: transformers (the model, the image
processor, the chat template's processor, fp32 forward passes) and llama.cpp's own `convert_hf_to_gguf.py`
(the text GGUF and the mmproj GGUF). This script only draws the random weights and the test images, calls
those tools and writes what they return as data (JSON, PNG, little-endian f32).

Exact versions used to make the shipped fixture (Python 3.11.7, CPU only, a virtualenv):

    pip install torch==2.15.0 torchvision==0.29.2 transformers==5.24.0 tokenizers==0.23.3 \
        safetensors==0.8.0 numpy==2.4.6 pillow==13.0.0 jinja2==3.1.6
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36   # the llama.cpp tree, pinned
    tar xzf llama_cpp_python-0.3.36.tar.gz                              # ggml-org/llama.cpp@0c1e57098

(`pip download` of the sdist needs scikit-build-core, cmake and ninja in the environment to prepare its
metadata, with --no-build-isolation.) The converter needs numpy, torch, sentencepiece-free `gguf-py` (from
the same tree, put on PYTHONPATH by this script) and `transformers` for the tokenizer.

    python tools/make_vision_fixture.py all OUT --llama-cpp DIR/vendor/llama.cpp --scratch /tmp/vision/work

Steps (each can run alone, in this order): `images`, `model`, `refs`, `gguf`. OUT must be the fixture folder;
the tokenizer files are copied from the text fixture `tests/fixtures/qwen35-tiny` (same vocabulary).
The HF checkpoint (bf16 safetensors) is written to SCRATCH/hf and is not shipped: `model` rebuilds it.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TEXT_FIXTURE = os.path.join(REPO, "tests", "fixtures", "qwen35-tiny")
SEED = 0

# special ids of the 4,129-token vocabulary (real Qwen3.5 id - 248044 + 4096)
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 4108, 4109, 4105, 4106

MIN_PIXELS, MAX_PIXELS = 65536, 1048576  # the release's limits (spec §3): 64 .. 1024 merged tokens

SYSTEM = "Apply the criterion to the evidence. Choose exactly one listed option. Answer with its letter only."


# --------------------------------------------------------------------------- images

def _scene(w, h, seed, mode="RGB", shapes=6, disk=None):
    """A deterministic picture: a coarse quantised two-axis gradient, random rectangles and ellipses,
    thin lines (hard edges for the resampler) and, optionally, a disk at (x, y, r)."""
    import numpy as np
    from PIL import Image, ImageDraw
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    c0, c1, c2 = rng.uniform(0, 255, 3), rng.uniform(-200, 200, 3), rng.uniform(-200, 200, 3)
    img = c0 + c1 * (xx / w)[..., None] + c2 * (yy / h)[..., None]
    img = np.clip(np.round(img / 16) * 16, 0, 255).astype(np.uint8)
    im = Image.fromarray(img, "RGB")
    d = ImageDraw.Draw(im)
    for i in range(shapes):
        x0, y0 = int(rng.integers(0, w - 8)), int(rng.integers(0, h - 8))
        x1, y1 = int(rng.integers(x0 + 4, w)), int(rng.integers(y0 + 4, h))
        col = tuple(int(v) for v in rng.integers(0, 256, 3))
        (d.rectangle if i % 2 == 0 else d.ellipse)([x0, y0, x1, y1], fill=col)
    for _ in range(4):
        pts = [int(rng.integers(0, w)), int(rng.integers(0, h)), int(rng.integers(0, w)), int(rng.integers(0, h))]
        d.line(pts, fill=tuple(int(v) for v in rng.integers(0, 256, 3)), width=int(rng.integers(1, 4)))
    if disk is not None:
        x, y, r = disk
        d.ellipse([x - r, y - r, x + r, y + r], fill=(250, 40, 30), outline=(0, 0, 0), width=2)
    if mode != "RGB":
        im = im.convert(mode)
    return im


# name, file, (width, height), PIL mode, what it exercises
TEST_IMAGES = [
    ("square", "square_256x256.png", (256, 256), "RGB", "exactly 256x256: no resize, 16x16 patches"),
    ("wide", "wide_640x360.jpg", (640, 360), "RGB", "a 640x360 video frame, JPEG: height rounds 360 -> 352"),
    ("tall", "tall_200x500_gray.png", (200, 500), "L", "grayscale PNG, portrait: 500 -> 512, 200 -> 192"),
    ("small", "small_120x90.png", (120, 90), "RGB", "below min_pixels: upscaled to 320x224 (the ceil path)"),
    ("large", "large_1500x1000.png", (1500, 1000), "RGB", "above max_pixels: 1248x832 (the floor path)"),
    ("tie", "tie_336x400.png", (336, 400), "RGB",
     "round half to even: 336/32 = 10.5 -> 10, 400/32 = 12.5 -> 12, so 320x384 (half away from zero: 352x416)"),
]
FRAME_SIZE = (384, 216)
N_FRAMES = 8


def frame_names():
    return [(f"frame{i}", f"frame{i}_384x216.png") for i in range(N_FRAMES)]


def make_images(out):
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    for k, (name, fn, (w, h), mode, _) in enumerate(TEST_IMAGES):
        im = _scene(w, h, seed=100 + k, mode=mode)
        path = os.path.join(out, "images", fn)
        if fn.endswith(".jpg"):
            im.save(path, quality=90, subsampling=2, optimize=False, progressive=False)
        else:
            im.save(path, optimize=True)
    # 8 "video frames": the same background, a red disk moving left to right
    w, h = FRAME_SIZE
    for i, (name, fn) in enumerate(frame_names()):
        im = _scene(w, h, seed=200, disk=(30 + i * 45, 60 + 12 * i, 22))
        im.save(os.path.join(out, "images", fn), optimize=True)


def load_image(out, fn):
    from PIL import Image
    im = Image.open(os.path.join(out, "images", fn))
    im.load()
    return im


# --------------------------------------------------------------------------- model

STD = {"embed": 0.5, "linear": 0.06, "lm_head": 0.15, "norm": 0.1, "conv": 0.3,
       "v_patch": 0.03, "v_pos": 0.5, "v_linear": 0.1, "v_bias": 0.05, "v_ln": 0.1, "v_merger": 0.06}


def make_config():
    from transformers import Qwen3_5Config
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    text = dict(
        model_type="qwen3_5_text",
        vocab_size=4129, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=layer_types, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=262144, hidden_act="silu", attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=4096, pad_token_id=None,
    )
    vision = dict(
        model_type="qwen3_5_vision",
        depth=3, hidden_size=64, hidden_act="gelu_pytorch_tanh", intermediate_size=128, num_heads=2,
        in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
        out_hidden_size=128, num_position_embeddings=2304,
    )
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                        video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def init_weights(model):
    """Deterministic init in sorted-name order, every value exactly representable in bfloat16."""
    import torch
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    sd = model.state_dict()
    new = {}
    for name in sorted(sd):
        shape = sd[name].shape
        randn = lambda: torch.randn(shape, generator=g, dtype=torch.float32)
        if name.startswith("model.visual."):
            if name.endswith("patch_embed.proj.weight"):
                t = randn() * STD["v_patch"]
            elif name.endswith("pos_embed.weight"):
                t = randn() * STD["v_pos"]
            elif ("norm1." in name or "norm2." in name or "merger.norm." in name) and name.endswith(".weight"):
                t = 1.0 + randn() * STD["v_ln"]                 # LayerNorm scale
            elif name.startswith("model.visual.merger.") and name.endswith(".weight"):
                t = randn() * STD["v_merger"]
            elif name.endswith(".weight") and len(shape) == 2:
                t = randn() * STD["v_linear"]
            elif name.endswith(".bias"):
                t = randn() * STD["v_bias"]
            else:
                raise ValueError(f"unhandled vision parameter {name} {tuple(shape)}")
        elif name.endswith("embed_tokens.weight"):
            t = randn() * STD["embed"]
        elif name == "lm_head.weight":
            t = randn() * STD["lm_head"]
        elif name.endswith("linear_attn.norm.weight"):      # plain-weight gated RMSNorm (identity = 1)
            t = 1.0 + randn() * STD["norm"]
        elif name.endswith("norm.weight"):                   # zero-centred RMSNorm: y = x_hat * (1 + w)
            t = randn() * STD["norm"]
        elif name.endswith("conv1d.weight"):
            t = randn() * STD["conv"]
        elif name.endswith("A_log"):                         # A = exp(A_log) uniform in [0.1, 8]
            u = torch.rand(shape, generator=g, dtype=torch.float32)
            t = torch.log(0.1 + u * 7.9)
        elif name.endswith("dt_bias"):                       # softplus(dt_bias) uniform in [0.01, 1]
            u = torch.rand(shape, generator=g, dtype=torch.float32)
            t = torch.log(torch.expm1(0.01 + u * 0.99))
        elif name.endswith(".weight") and len(shape) == 2:
            t = randn() * STD["linear"]
        else:
            raise ValueError(f"unhandled parameter {name} {tuple(shape)}")
        new[name] = t.to(torch.bfloat16).to(torch.float32)
    model.load_state_dict(new, strict=True)
    return model


def make_processor(out):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    tok = AutoTokenizer.from_pretrained(out)
    ip = Qwen2VLImageProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                               patch_size=16, temporal_patch_size=2, merge_size=2,
                               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    vp = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    with open(os.path.join(out, "chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    return Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template)


def build_model(out, scratch):
    import torch
    from transformers import GenerationConfig, Qwen3_5ForConditionalGeneration
    for fn in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(os.path.join(TEXT_FIXTURE, fn), os.path.join(out, fn))
    hf = os.path.join(scratch, "hf")
    os.makedirs(hf, exist_ok=True)
    cfg = make_config()
    torch.manual_seed(SEED)
    model = Qwen3_5ForConditionalGeneration(cfg)
    init_weights(model)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(hf, safe_serialization=True)
    gen = GenerationConfig(eos_token_id=[4098, 4096], pad_token_id=4096, do_sample=False)
    gen.save_pretrained(hf)
    proc = make_processor(out)
    proc.save_pretrained(hf)
    for fn in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(os.path.join(out, fn), os.path.join(hf, fn))
    for fn in ("config.json", "generation_config.json", "processor_config.json", "preprocessor_config.json",
               "video_preprocessor_config.json"):
        if os.path.exists(os.path.join(hf, fn)):
            shutil.copyfile(os.path.join(hf, fn), os.path.join(out, fn))


# --------------------------------------------------------------------------- references

def f7(x):
    return float(f"{float(x):.7g}")


def flist(t):
    return [f7(v) for v in t.reshape(-1).tolist()]


def digest(t, n_first=8, stride=None):
    import torch
    t64 = t.detach().to(torch.float64).reshape(-1)
    d = {"shape": list(t.shape), "sum": float(t64.sum()), "sum_sq": float((t64 * t64).sum()),
         "abs_max": float(t64.abs().max()), "first": flist(t64[:n_first])}
    if stride:
        d["sample_stride"] = stride
        d["sample"] = flist(t64[::stride])
    return d


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def write_f32(path, t):
    import numpy as np
    arr = t.detach().float().contiguous().numpy().astype("<f4")
    arr.tofile(path)
    return hashlib.sha256(arr.tobytes()).hexdigest()


def image_parts(state_text, n_images, placed):
    """Spec §3: marks place images; otherwise one image goes first, then '\\n\\n' and the state text; several
    go first as lines 'Image i: <slot>' joined by '\\n', then '\\n\\n' and the state text. Returns the
    state as a list of ('text', s) / ('image', None) parts."""
    parts = []
    if n_images == 0:
        return [("text", state_text)]
    if placed:
        pieces = state_text.split("<image>")
        assert len(pieces) - 1 == n_images
        for i, p in enumerate(pieces):
            if p:
                parts.append(("text", p))
            if i < n_images:
                parts.append(("image", None))
        return parts
    if n_images == 1:
        parts.append(("image", None))
    else:
        for i in range(n_images):
            parts.append(("text", ("\n" if i else "") + f"Image {i + 1}: "))
            parts.append(("image", None))
    if state_text:
        parts.append(("text", "\n\n" + state_text))
    return parts


def user_content(state_parts, question, options):
    tail = f"\n\nQuestion: {question}\nOptions:\n" + "\n".join(f"{chr(65 + i)}) {o}" for i, o in enumerate(options))
    parts = [("text", "Evidence:\n")] + state_parts + [("text", tail)]
    merged = []
    for kind, s in parts:                      # join adjacent text parts
        if kind == "text" and merged and merged[-1]["type"] == "text":
            merged[-1]["text"] += s
        elif kind == "text":
            merged.append({"type": "text", "text": s})
        else:
            merged.append({"type": "image"})
    return merged


FRAMES = [n for n, _ in frame_names()]
PROMPTS = [
    # name, images, placed, state text, question, options
    ("text_only", [], False, "The loading dock camera is offline today.",
     "Is the dock in use?", ["yes", "no"]),
    ("one_first", ["square"], False, "A photo from the loading dock.",
     "What does the picture show?", ["A truck", "An empty dock", "A person", "Nothing readable"]),
    ("one_placed", ["wide"], True, "The frame <image> was taken at 7 am by the north camera.",
     "Is the gate open?", ["yes", "no", "cannot tell"]),
    ("two_first", ["tall", "small"], False, "Two snapshots of the same shelf.",
     "Did the shelf change?", ["yes", "no"]),
    ("two_placed", ["small", "square"], True, "Before: <image>\nAfter: <image>\nThe shelf was restocked at noon.",
     "Which picture is brighter?", ["the first", "the second", "the same"]),
    ("eight_first", FRAMES, False, "Eight frames of one delivery, in order.",
     "Where does the red disk end up?", ["left", "middle", "right", "it leaves the frame"]),
    ("eight_placed", FRAMES, True,
     "A delivery, frame by frame:\n" + "\n".join(f"t={i}s <image>" for i in range(N_FRAMES)) + "\nEnd of clip.",
     "Does the red disk move?", ["yes", "no"]),
]


def capture_vision(visual, pixel_values, grid_thw):
    """Run the vision tower once, capturing the patch embedding, the input of block 0 (after the learned
    position embedding), each block's output and the merger output."""
    import torch
    cap = {}
    hooks = [visual.patch_embed.register_forward_hook(lambda m, i, o: cap.__setitem__("patch_embed", o)),
             visual.blocks[0].register_forward_pre_hook(
                 lambda m, a, kw: cap.__setitem__("pos_added", (a[0] if a else kw["hidden_states"]).clone()),
                 with_kwargs=True),
             visual.merger.norm.register_forward_hook(lambda m, i, o: cap.__setitem__("merger_norm", o))]
    for b, blk in enumerate(visual.blocks):
        hooks.append(blk.register_forward_hook(lambda m, i, o, b=b: cap.__setitem__(f"block{b}", o)))
    with torch.no_grad():
        out = visual(pixel_values, grid_thw=grid_thw)
    for h in hooks:
        h.remove()
    cap["last_hidden_state"] = out.last_hidden_state
    cap["merged"] = out.pooler_output
    return cap


def make_refs(out, scratch):
    import numpy as np
    import torch
    from PIL import Image
    import transformers
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    torch.set_num_threads(2)
    hf = os.path.join(scratch, "hf")
    proc = make_processor(out)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    visual = model.model.visual
    ip = proc.image_processor
    pil_ip = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                      patch_size=16, temporal_patch_size=2, merge_size=2,
                                      image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    os.makedirs(os.path.join(out, "resized"), exist_ok=True)
    os.makedirs(os.path.join(out, "vision"), exist_ok=True)

    all_images = [(n, fn, desc) for n, fn, _, _, desc in TEST_IMAGES] + \
                 [(n, fn, "video frame (8-image prompts)") for n, fn in frame_names()]
    img_ref, vis_ref = {}, {}
    embeds = {}
    for name, fn, desc in all_images:
        im = load_image(out, fn)
        rgb = im.convert("RGB")
        raw = np.asarray(rgb, dtype=np.uint8)
        feats = ip(images=[im], return_tensors="pt")
        pv, thw = feats["pixel_values"], feats["image_grid_thw"]
        t, gh, gw = thw[0].tolist()
        rh, rw = gh * 16, gw * 16
        # un-patchify the first temporal copy to get the resized image back, and check it is uint8-exact
        x = pv.reshape(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)[:, :, :, :, :, 0]       # R C r c ch py px
        x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, rh, rw)                         # ch, R r py, C c px
        u8 = torch.round(x * 127.5 + 127.5)
        assert float((u8 - (x * 127.5 + 127.5)).abs().max()) < 1e-3, "resized image is not uint8-valued"
        u8 = u8.clamp(0, 255).to(torch.uint8)
        renorm = (u8.float() - 127.5) / 127.5
        exact = bool(torch.equal(renorm, x))
        assert torch.equal(pv.reshape(-1, 3, 2, 16, 16)[:, :, 0], pv.reshape(-1, 3, 2, 16, 16)[:, :, 1])
        resized_fn = f"{name}_{rw}x{rh}.png"
        Image.fromarray(u8.permute(1, 2, 0).numpy(), "RGB").save(os.path.join(out, "resized", resized_fn),
                                                                   optimize=True)
        pil_pv = pil_ip(images=[im], return_tensors="pt")["pixel_values"]
        assert pil_pv.shape == pv.shape
        img_ref[name] = {
            "file": f"images/{fn}", "what": desc, "mode": im.mode, "width": im.width, "height": im.height,
            "decoded_rgb_sha256": hashlib.sha256(raw.tobytes()).hexdigest(),
            "decoded_rgb_sum": int(raw.astype(np.int64).sum()),
            "resized_width": rw, "resized_height": rh, "grid_thw": [t, gh, gw],
            "n_patches": t * gh * gw, "n_tokens": t * gh * gw // 4,
            "resized_file": f"resized/{resized_fn}",
            "pixel_values_equal_normalized_resized_file": exact,
            "pixel_values": digest(pv, n_first=256, stride=1021),
            "pil_backend_max_abs_diff": float((pil_pv - pv).abs().max()),
            "pil_backend_mean_abs_diff": float((pil_pv - pv).abs().mean()),
        }
        cap = capture_vision(visual, pv, thw)
        merged = cap["merged"]
        embeds[name] = merged
        emb_fn = f"vision/{name}.f32"
        sha = write_f32(os.path.join(out, emb_fn), merged)
        v = {"grid_thw": [t, gh, gw], "n_tokens": merged.shape[0], "embeddings_file": emb_fn,
             "embeddings_sha256": sha, "embeddings": digest(merged, n_first=16, stride=97)}
        if name in ("square", "small"):     # full intermediates for two images (first 8 rows of each)
            v["stages_first_rows"] = {k: flist(cap[k][:8]) for k in
                                      ["patch_embed", "pos_added"] + [f"block{b}" for b in range(len(visual.blocks))]
                                      + ["merger_norm"]}
            v["stages_first_rows_shape"] = [8, cap["patch_embed"].shape[1]]
        v["last_hidden_state"] = digest(cap["last_hidden_state"], n_first=16)
        vis_ref[name] = v
        print(f"{name}: {im.width}x{im.height} -> {rw}x{rh} grid {t,gh,gw} tokens {merged.shape[0]} "
              f"exact={exact} pil diff={img_ref[name]['pil_backend_max_abs_diff']:.4f} "
              f"emb rms={float(merged.pow(2).mean().sqrt()):.3f}")

    # batched run of all frames together must equal the one-at-a-time runs (images never attend to each other)
    fr = [load_image(out, fn) for _, fn in frame_names()]
    feats = ip(images=fr, return_tensors="pt")
    with torch.no_grad():
        batched = visual(feats["pixel_values"], grid_thw=feats["image_grid_thw"]).pooler_output
    single = torch.cat([embeds[n] for n in FRAMES])
    batch_diff = float((batched - single).abs().max())

    write_json(os.path.join(out, "ref_images.json"), {
        "tool": f"transformers {transformers.__version__} Qwen2VLImageProcessor (torchvision backend), torch "
                f"{torch.__version__}",
        "config": {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 16, "merge_size": 2,
                   "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                   "resample": "bicubic, antialias, on uint8 (torchvision)", "factor": 32},
        "pixel_values_layout": "rows = patches in merge-window order (R, C, r, c); each row = 3 channels x 2 "
                               "temporal copies x 16 x 16, the two temporal copies identical",
        "images": img_ref})
    write_json(os.path.join(out, "ref_vision.json"), {
        "tool": f"transformers {transformers.__version__} Qwen3_5VisionModel fp32 eager, torch {torch.__version__}",
        "embeddings_format": "little-endian float32, row-major [n_tokens, 128], merged-grid raster order",
        "frames_batched_vs_single_max_abs_diff": batch_diff,
        "deepstack": "none: Qwen3.5's vision tower has no deepstack (multi-level) features; only the merger "
                     "output is injected, at the <|image_pad|> positions",
        "images": vis_ref})

    # ---- prompts
    prompts = []
    for pname, imgs, placed, state, question, options in PROMPTS:
        content = user_content(image_parts(state, len(imgs), placed), question, options)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
        text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
        pil = [load_image(out, dict((n, fn) for n, fn, *_ in TEST_IMAGES + [(a, b) for a, b in frame_names()])[n])
               for n in imgs]
        if pil:
            inputs = proc(text=[text], images=pil, return_tensors="pt")
        else:
            inputs = proc(text=[text], return_tensors="pt")
        ids = inputs["input_ids"]
        kw = dict(input_ids=ids, attention_mask=inputs["attention_mask"])
        entry = {"name": pname, "images": imgs, "placed": placed, "state": state, "messages": messages,
                 "text": text, "n_tokens": ids.shape[1]}
        if pil:
            kw.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                      mm_token_type_ids=inputs["mm_token_type_ids"])
            pos, delta = model.model.get_rope_index(ids, inputs["mm_token_type_ids"],
                                                    image_grid_thw=inputs["image_grid_thw"],
                                                    attention_mask=inputs["attention_mask"])
            entry["image_grid_thw"] = inputs["image_grid_thw"].tolist()
            runs, i, seq = [], 0, ids[0].tolist()
            while i < len(seq):
                if seq[i] == IMAGE_PAD:
                    j = i
                    while j < len(seq) and seq[j] == IMAGE_PAD:
                        j += 1
                    runs.append({"start": i, "count": j - i})
                    i = j
                else:
                    i += 1
            entry["image_pad_runs"] = runs
            entry["position_ids"] = pos[:, 0].tolist()       # [3][n_tokens]: T, H, W
            entry["rope_delta"] = int(delta[0, 0])
            entry["next_position"] = int(pos.max()) + 1
        else:
            entry["position_ids"] = None
            entry["next_position"] = ids.shape[1]
        hs = {}
        hooks = [model.model.language_model.layers[k].register_forward_hook(
            lambda m, i, o, k=k: hs.__setitem__(k, (o[0] if isinstance(o, tuple) else o)[0, -1].clone()))
            for k in range(len(model.model.language_model.layers))]
        with torch.no_grad():
            o = model(**kw, use_cache=False, output_hidden_states=True)
        for h in hooks:
            h.remove()
        logits = o.logits[0, -1]
        entry["input_ids"] = seq if pil else ids[0].tolist()
        entry["last_logits"] = flist(logits)
        entry["argmax"] = int(logits.argmax())
        top = torch.topk(logits, 5)
        entry["top5"] = {"ids": top.indices.tolist(), "logits": flist(top.values)}
        entry["last_hidden"] = {"after_embedding": flist(o.hidden_states[0][0, -1]),
                                **{f"after_layer{k}": flist(hs[k]) for k in sorted(hs)},
                                "after_final_norm": flist(o.hidden_states[-1][0, -1])}
        if pil:   # the same prompt with the image features given precomputed, to show they are what is injected
            embeds_cat = torch.cat([embeds[n] for n in imgs])
            emb = model.model.get_input_embeddings()(ids)
            emb[ids == IMAGE_PAD] = embeds_cat
            with torch.no_grad():
                o2 = model(inputs_embeds=emb, attention_mask=inputs["attention_mask"],
                           position_ids=pos, use_cache=False)
            entry["check_precomputed_embeddings_max_abs_diff"] = float((o2.logits[0, -1] - logits).abs().max())
        prompts.append(entry)
        print(f"{pname}: {ids.shape[1]} tokens, argmax {entry['argmax']}, max logit {float(logits.max()):.3f}, "
              f"logit std {float(logits.std()):.3f}")
    sensitivity = prompt_sensitivity(model, prompts, embeds)
    write_json(os.path.join(out, "ref_prompts.json"), {
        "tool": f"transformers {transformers.__version__} Qwen3_5ForConditionalGeneration fp32 eager, "
                f"Qwen3VLProcessor, torch {torch.__version__}",
        "note": "last-position logits of the whole prompt, one forward pass without a cache; position_ids are "
                "get_rope_index's (T, H, W) rows; last_hidden.after_layerK is layer K's output at the last "
                "position (after_final_norm is the final RMSNorm's)",
        "sensitivity": sensitivity,
        "prompts": prompts})


def prompt_sensitivity(model, prompts, embeds):
    """How far the last-position logits move (max |delta| against the reference) under the placement bugs an
    engine could make, so a tolerance of 1e-3 is known to catch them."""
    import torch
    res = {}
    for e in prompts:
        if not e["images"]:
            continue
        ids = torch.tensor([e["input_ids"]])
        ref = torch.tensor(e["last_logits"])
        pos = torch.tensor(e["position_ids"])[:, None, :]

        def run(names, position_ids):
            x = model.model.get_input_embeddings()(ids).detach().clone()
            x[ids == IMAGE_PAD] = torch.cat([embeds[n] for n in names])
            with torch.no_grad():
                lg = model(inputs_embeds=x, position_ids=position_ids, use_cache=False).logits[0, -1]
            return float((lg - ref).abs().max())
        seq = torch.arange(ids.shape[1])[None, None, :].expand(3, 1, -1)
        r = {"reference_path_precomputed": run(e["images"], pos),
             "plain_1d_positions": run(e["images"], seq),
             "h_and_w_positions_swapped": run(e["images"], pos[[0, 2, 1]])}
        if len(e["images"]) > 1:
            r["images_in_reverse_order"] = run(e["images"][::-1], pos)
        res[e["name"]] = r
        print(e["name"], r)
    return res


# --------------------------------------------------------------------------- GGUF

CONVERT_WRAPPER = r"""
import sys, runpy, logging
llama = sys.argv[1]
sys.path.insert(0, llama + "/gguf-py"); sys.path.insert(0, llama)
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        orig = cls.get_vocab_base_pre
        def patched(self, tokenizer, _orig=orig):
            try:
                return _orig(self, tokenizer)
            except NotImplementedError:
                # the 4,096-rank cut of the Qwen3.5 vocabulary has an unknown hash: use the real
                # Qwen3.5 pre-tokenizer (the regex is unchanged)
                logging.getLogger("wrapper").warning("unknown pre-tokenizer hash: using qwen35")
                return "qwen35"
        cls.get_vocab_base_pre = patched
sys.argv = [llama + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(llama + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def make_gguf(out, scratch, llama):
    hf = os.path.join(scratch, "hf")
    text_gguf = os.path.join(out, "tiny-vl-BF16.gguf")
    mmproj = os.path.join(out, "mmproj-tiny-vl-F32.gguf")
    for args in ([hf, "--outtype", "bf16", "--no-mtp", "--outfile", text_gguf],
                 [hf, "--mmproj", "--outtype", "f32", "--outfile", mmproj]):
        cmd = [sys.executable, "-c", CONVERT_WRAPPER, llama] + args
        print("+", " ".join(cmd[3:]))
        subprocess.run(cmd, check=True)
    checks = verify_ggufs(scratch, llama, text_gguf, mmproj)
    describe_ggufs(out, llama, [text_gguf, mmproj], checks)


def verify_ggufs(scratch, llama, text_gguf, mmproj):
    """Every mmproj tensor against its HF source (exact), and the text GGUF's embedding and output head."""
    sys.path.insert(0, os.path.join(llama, "gguf-py"))
    import numpy as np
    import torch
    from gguf import GGUFReader
    from safetensors.torch import load_file
    sd = {k: v.float() for k, v in load_file(os.path.join(scratch, "hf", "model.safetensors")).items()}
    V = "model.visual."
    src = {"v.patch_embd.weight": sd[V + "patch_embed.proj.weight"][:, :, 0],
           "v.patch_embd.weight.1": sd[V + "patch_embed.proj.weight"][:, :, 1],
           "v.patch_embd.bias": sd[V + "patch_embed.proj.bias"],
           "v.position_embd.weight": sd[V + "pos_embed.weight"],
           "v.post_ln.weight": sd[V + "merger.norm.weight"], "v.post_ln.bias": sd[V + "merger.norm.bias"],
           "mm.0.weight": sd[V + "merger.linear_fc1.weight"], "mm.0.bias": sd[V + "merger.linear_fc1.bias"],
           "mm.2.weight": sd[V + "merger.linear_fc2.weight"], "mm.2.bias": sd[V + "merger.linear_fc2.bias"]}
    names = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
             "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
    for k in sd:
        if k.startswith(V + "blocks."):
            b, rest = k[len(V + "blocks."):].split(".", 1)
            mod, kind = rest.rsplit(".", 1)
            g = [gk for gk, hk in names.items() if hk == mod][0]
            src[f"v.blk.{b}.{g}.{kind}"] = sd[k]
    r = GGUFReader(mmproj)
    seen, bad = 0, []
    for t in r.tensors:
        a = np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))
        if not np.array_equal(a, src[t.name].numpy().reshape(a.shape)):
            bad.append(t.name)
        seen += 1
    assert seen == len(src), (seen, len(src))
    rt = GGUFReader(text_gguf)
    tt = {t.name: t for t in rt.tensors}
    text_bad = []
    for g, h in (("token_embd.weight", "model.language_model.embed_tokens.weight"), ("output.weight", "lm_head.weight")):
        raw = np.asarray(tt[g].data).view(np.uint16).astype(np.uint32) << 16
        if not np.array_equal(raw.view(np.float32).reshape(sd[h].shape), sd[h].numpy()):
            text_bad.append(g)
    checks = {"mmproj_tensors_equal_hf_exactly": f"{seen - len(bad)}/{seen}", "mmproj_mismatches": bad,
              "text_embd_and_output_equal_hf_exactly": not text_bad}
    print(checks)
    assert not bad and not text_bad
    return checks


def describe_ggufs(out, llama, paths, checks=None):
    sys.path.insert(0, os.path.join(llama, "gguf-py"))
    import numpy as np
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType
    res = {}
    for p in paths:
        r = GGUFReader(p)
        meta = {}
        for k, f in r.fields.items():
            if k.startswith("GGUF."):
                continue
            t = f.types[0] if f.types else None
            if t == GGUFValueType.ARRAY:
                vals = f.contents()
                meta[k] = vals if len(vals) <= 16 else {"len": len(vals), "first8": vals[:8]}
            else:
                meta[k] = f.contents()
        tensors = [{"name": t.name, "type": t.tensor_type.name, "ne": [int(x) for x in t.shape],
                    "n_elements": int(t.n_elements), "n_bytes": int(t.n_bytes), "offset": int(t.data_offset),
                    "sum": float(np.asarray(t.data, dtype=np.float64).sum())
                    if t.tensor_type.name in ("F32", "F16") else None}
                   for t in r.tensors]
        with open(p, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        res[os.path.basename(p)] = {"size": os.path.getsize(p), "sha256": sha, "metadata": meta,
                                    "tensors": tensors}
    if checks:
        res["checks"] = checks
    write_json(os.path.join(out, "tensors.json"), res)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["images", "model", "refs", "gguf", "all"])
    ap.add_argument("out")
    ap.add_argument("--scratch", default="/tmp/vision/work")
    ap.add_argument("--llama-cpp", help="the llama.cpp tree (vendor/llama.cpp of the llama-cpp-python sdist)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.scratch, exist_ok=True)
    if a.step in ("images", "all"):
        make_images(a.out)
    if a.step in ("model", "all"):
        build_model(a.out, a.scratch)
    if a.step in ("refs", "all"):
        make_refs(a.out, a.scratch)
    if a.step in ("gguf", "all"):
        if not a.llama_cpp:
            sys.exit("--llama-cpp DIR is needed for the gguf step")
        make_gguf(a.out, a.scratch, a.llama_cpp)
