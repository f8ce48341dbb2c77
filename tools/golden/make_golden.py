#!/usr/bin/env python3
"""Generate the golden fixtures under tests/data/golden/ (see tools/golden/README.md).

Everything is deterministic: fixed seeds, fixed image parameters, fixed library versions
(tools/golden/requirements.txt). Re-running the script rewrites the same files.

Three groups of fixtures:

1. images/: small synthetic images (gradients, shapes, noise) in PNG, JPEG and WebP, plus one
   corrupt file and one unsupported format for the error tests.
2. preprocess/: the output of transformers' PIL image processor (Qwen2VLImageProcessorPil, the
   slow one, not the torchvision one) for every image, once with Qwen2/2.5-VL settings and once
   with Qwen3-VL settings.
3. qwen2_vl/, qwen2_5_vl/, qwen3_vl/: a small random-weight vision tower of each family with
   non-default dims, saved as a Hugging Face checkpoint (config.json, preprocessor_config.json,
   safetensors), plus golden.safetensors with the inputs (two images in one call) and outputs.

manifest.json at the top describes every file.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import PIL
import safetensors
import torch
import transformers
from PIL import Image, ImageDraw
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "golden"

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]

# Processor settings of the two families. min/max pixels are set per image below so that the
# fixtures stay small; the published limits are covered by the Rust smart_resize unit tests.
QWEN2_PROC = dict(patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD)
QWEN3_PROC = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=HALF, image_std=HALF)


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def synthetic(width: int, height: int, seed: int, channels: int = 3) -> np.ndarray:
    """Gradients + shapes + noise, uint8 HxWxC. Structure at several scales so that resize
    errors show up, noise so that every pixel differs."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    fx, fy = x / max(width - 1, 1), y / max(height - 1, 1)
    base = np.stack(
        [
            255 * fx,
            255 * fy,
            127.5 + 127.5 * np.sin(2 * math.pi * (fx * 3 + fy * 2)),
        ],
        axis=-1,
    )
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.randint(0, width), rng.randint(0, height)
        x1, y1 = x0 + rng.randint(2, max(3, width // 2)), y0 + rng.randint(2, max(3, height // 2))
        color = tuple(int(c) for c in rng.randint(0, 256, size=3))
        if rng.rand() < 0.5:
            draw.rectangle([x0, y0, x1, y1], fill=color)
        else:
            draw.ellipse([x0, y0, x1, y1], fill=color)
    draw.line([0, 0, width - 1, height - 1], fill=(255, 255, 255), width=1)
    arr = np.asarray(img).astype(np.float64)
    arr += rng.normal(0, 12, size=arr.shape)
    arr = np.clip(np.round(arr), 0, 255).astype(np.uint8)
    if channels == 4:
        # Alpha: fully opaque, fully transparent and partial areas (a radial ramp).
        r = np.sqrt((fx - 0.5) ** 2 + (fy - 0.5) ** 2)
        alpha = np.clip(255 * (1.2 - 2.0 * r), 0, 255)
        alpha[: height // 4, : width // 4] = 0
        alpha = np.round(alpha).astype(np.uint8)
        arr = np.concatenate([arr, alpha[..., None]], axis=-1)
    return arr


# name -> (width, height, format, seed, extra save kwargs)
IMAGES = {
    "nonsquare.jpg": (150, 100, "JPEG", 1, dict(quality=90)),
    "tiny.png": (30, 20, "PNG", 2, {}),
    "large.jpg": (500, 400, "JPEG", 3, dict(quality=85)),
    "alpha.png": (64, 48, "PNG", 4, {}),
    "photo.webp": (90, 60, "WEBP", 5, dict(quality=80, method=4)),
    # Inputs of the tower goldens (two per model, see MODELS).
    "tower_a.png": (90, 62, "PNG", 6, {}),
    "tower_b.jpg": (60, 31, "JPEG", 7, dict(quality=92)),
    "tower_c.png": (118, 80, "PNG", 8, {}),
}


def write_images(out: Path) -> dict:
    d = out / "images"
    d.mkdir(parents=True, exist_ok=True)
    meta = {}
    for name, (w, h, fmt, seed, kw) in IMAGES.items():
        channels = 4 if name == "alpha.png" else 3
        arr = synthetic(w, h, seed, channels)
        img = Image.fromarray(arr, "RGBA" if channels == 4 else "RGB")
        img.save(d / name, format=fmt, **kw)
        meta[name] = dict(width=w, height=h, format=fmt.lower(), mode=img.mode)
    # Error cases: a PNG cut in the middle of its image data, and a GIF (a real, valid image in
    # a format the preprocessor does not accept).
    good = (d / "tiny.png").read_bytes()
    (d / "corrupt.png").write_bytes(good[: len(good) // 2])
    meta["corrupt.png"] = dict(error="truncated PNG (first half of tiny.png)")
    gif = Image.fromarray(synthetic(16, 12, 9), "RGB").convert("P")
    gif.save(d / "unsupported.gif", format="GIF")
    meta["unsupported.gif"] = dict(error="GIF is not an accepted format", width=16, height=12)
    return meta


# ---------------------------------------------------------------------------------------------
# Preprocessing goldens
# ---------------------------------------------------------------------------------------------

# (image, alpha handling, {config: (min_pixels, max_pixels)}). Decoding and alpha handling do
# not depend on the config, so Qwen3-VL settings run only on the cases whose sizes differ.
PREPROCESS_CASES = [
    ("nonsquare.jpg", "drop", {"qwen2_vl": (3136, 6272), "qwen3_vl": (4096, 6144)}),
    ("tiny.png", "drop", {"qwen2_vl": (3136, 12845056), "qwen3_vl": (4096, 16777216)}),
    ("large.jpg", "drop", {"qwen2_vl": (3136, 6272)}),
    ("alpha.png", "drop", {"qwen2_vl": (3136, 12845056)}),
    ("alpha.png", "composite_white", {"qwen2_vl": (3136, 12845056)}),
    ("photo.webp", "drop", {"qwen2_vl": (3136, 12845056)}),
]

PROC_SETTINGS = {"qwen2_vl": QWEN2_PROC, "qwen3_vl": QWEN3_PROC}


def load_rgb(path: Path, alpha: str):
    """The RGB image the processor sees.

    "drop": Pillow's convert("RGB"), which discards the alpha channel (what transformers 4.x's
    convert_to_rgb did). "composite_white": the image is passed as is and transformers'
    own convert_to_rgb composites it onto white (transformers >= 5)."""
    img = Image.open(path)
    img.load()
    if alpha == "drop":
        return img.convert("RGB")
    assert alpha == "composite_white"
    return img


def make_processor(settings: dict, min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, **settings)


def write_preprocess(out: Path) -> dict:
    d = out / "preprocess"
    d.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for cfg, settings in PROC_SETTINGS.items():
        tensors = {}
        entries = []
        factor = settings["patch_size"] * settings["merge_size"]
        for image, alpha, limits in PREPROCESS_CASES:
            if cfg not in limits:
                continue
            min_px, max_px = limits[cfg]
            img = load_rgb(out / "images" / image, alpha)
            proc = make_processor(settings, min_px, max_px)
            res = proc(images=[img], return_tensors="np")
            pv = np.ascontiguousarray(res["pixel_values"].astype(np.float32))
            grid = res["image_grid_thw"].astype(np.int64)
            w, h = img.size
            rh, rw = smart_resize(h, w, factor=factor, min_pixels=min_px, max_pixels=max_px)
            assert grid.tolist() == [[1, rh // settings["patch_size"], rw // settings["patch_size"]]]
            key = f"{image}:{alpha}"
            tensors[f"{key}.pixel_values"] = pv
            tensors[f"{key}.grid_thw"] = grid[0]
            # Pillow's resized uint8 image (before rescale/normalize), HWC, to tell resize
            # differences from decode differences.
            rgb = convert_to_rgb(img, return_numpy=True)
            resized = np.asarray(Image.fromarray(rgb).resize((rw, rh), resample=Image.BICUBIC))
            tensors[f"{key}.resized_rgb"] = np.ascontiguousarray(resized)
            entries.append(
                dict(
                    key=key,
                    image=f"images/{image}",
                    alpha=alpha,
                    min_pixels=min_px,
                    max_pixels=max_px,
                    original_width=w,
                    original_height=h,
                    resized_width=rw,
                    resized_height=rh,
                    grid_thw=grid[0].tolist(),
                    tokens=int(grid[0].prod()) // settings["merge_size"] ** 2,
                    pixel_values_shape=list(pv.shape),
                )
            )
        fname = f"{cfg}.safetensors"
        save_numpy(tensors, str(d / fname), metadata={"generator": "tools/golden/make_golden.py"})
        manifest[cfg] = dict(
            file=f"preprocess/{fname}",
            processor="Qwen2VLImageProcessorPil",
            patch_size=settings["patch_size"],
            merge_size=settings["merge_size"],
            temporal_patch_size=settings["temporal_patch_size"],
            image_mean=settings["image_mean"],
            image_std=settings["image_std"],
            rescale_factor=1 / 255,
            tensors="for each case KEY = '<image>:<alpha>': KEY.pixel_values f32 [patches, C*T*P*P], "
            "KEY.grid_thw i64 [3], KEY.resized_rgb u8 [H, W, 3] (Pillow's bicubic resize output)",
            cases=entries,
        )
    return manifest


# ---------------------------------------------------------------------------------------------
# Tower goldens
# ---------------------------------------------------------------------------------------------

MODELS = {
    # Full-model config.json with vision_config, weights prefixed `visual.` in one file, f32,
    # preprocessor_config.json with min_pixels/max_pixels.
    "qwen2_vl": dict(
        config={
            "architectures": ["Qwen2VLForConditionalGeneration"],
            "model_type": "qwen2_vl",
            "hidden_size": 48,
            "torch_dtype": "float32",
            "vision_config": {
                "depth": 2,
                "embed_dim": 64,
                "mlp_ratio": 2,
                "num_heads": 4,
                "in_chans": 3,
                "hidden_size": 48,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "spatial_patch_size": 14,
                "temporal_patch_size": 2,
            },
        },
        preprocessor={
            "min_pixels": 784,
            "max_pixels": 4704,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
        },
        images=["tower_a.png", "tower_b.jpg"],
        prefix="visual.",
        extra={"model.embed_tokens.weight": (16, 48), "lm_head.weight": (16, 48)},
        dtype="float32",
        shards=1,
        seed=101,
    ),
    # Full-model config.json, weights prefixed `model.visual.` in 2 shards with an index, bf16
    # on disk; window attention with one full-attention layer, windows of 2x2 merge units.
    "qwen2_5_vl": dict(
        config={
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "hidden_size": 56,
            "torch_dtype": "bfloat16",
            "vision_config": {
                "depth": 3,
                "hidden_act": "silu",
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_heads": 4,
                "in_chans": 3,
                "out_hidden_size": 56,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "spatial_patch_size": 14,
                "window_size": 56,
                "fullatt_block_indexes": [1],
                "tokens_per_second": 2,
                "temporal_patch_size": 2,
            },
        },
        preprocessor={
            "min_pixels": 784,
            "max_pixels": 9408,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
        },
        images=["tower_c.png", "tower_b.jpg"],
        prefix="model.visual.",
        extra={"model.language_model.embed_tokens.weight": (16, 56), "lm_head.weight": (16, 56)},
        dtype="bfloat16",
        shards=2,
        seed=202,
    ),
    # Bare vision config.json, weights without prefix in one file, f16 on disk,
    # preprocessor_config.json with size.shortest_edge/longest_edge.
    "qwen3_vl": dict(
        config={
            "model_type": "qwen3_vl",
            "depth": 3,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 64,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "num_heads": 4,
            "num_position_embeddings": 64,
            "out_hidden_size": 72,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "deepstack_visual_indexes": [0, 2],
        },
        preprocessor={
            "size": {"longest_edge": 6144, "shortest_edge": 1024},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": HALF,
            "image_std": HALF,
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
        },
        images=["tower_a.png", "tower_b.jpg"],
        prefix="",
        extra={},
        dtype="float16",
        shards=1,
        seed=303,
    ),
}

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(name: str, spec: dict):
    cfg = spec["config"]
    if name == "qwen2_vl":
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        vcfg = Qwen2VLConfig(**cfg).vision_config
        cls = Qwen2VisionTransformerPretrainedModel
    elif name == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        vcfg = Qwen2_5_VLConfig(**cfg).vision_config
        cls = Qwen2_5_VisionTransformerPretrainedModel
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        vcfg = Qwen3VLVisionConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        cls = Qwen3VLVisionModel
    vcfg._attn_implementation = "eager"
    torch.manual_seed(spec["seed"])
    model = cls._from_config(vcfg, torch_dtype=torch.float32)
    model.eval()
    return model, vcfg


def randomize(model: torch.nn.Module, seed: int, storage: torch.dtype) -> None:
    """Non-trivial random init, rounded to the on-disk dtype so that the f32 model runs on
    exactly the values the checkpoint holds."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            leaf = pname.rsplit(".", 1)[-1]
            is_norm = any(s in pname for s in ("norm", "ln_q")) and p.dim() == 1
            if is_norm and leaf == "weight":
                v = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            elif leaf == "bias":
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif "pos_embed" in pname:
                v = 0.2 * torch.randn(p.shape, generator=g)
            else:
                fan_in = p[0].numel()
                std = min(0.2, max(0.02, 1.0 / math.sqrt(fan_in)))
                v = std * torch.randn(p.shape, generator=g)
            p.copy_(v.to(storage).to(torch.float32))


def write_model(out: Path, name: str, spec: dict) -> dict:
    d = out / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model, vcfg = build_model(name, spec)
    storage = TORCH_DTYPES[spec["dtype"]]
    randomize(model, spec["seed"], storage)

    # Checkpoint files exactly as published checkpoints lay them out.
    (d / "config.json").write_text(json.dumps(spec["config"], indent=2) + "\n")
    (d / "preprocessor_config.json").write_text(json.dumps(spec["preprocessor"], indent=2) + "\n")

    state = {spec["prefix"] + k: v.detach().to(storage).contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    for k, shape in spec["extra"].items():
        # Language-model tensors the vision loader must skip.
        state[k] = (0.02 * torch.randn(shape, generator=g)).to(storage)
    names = sorted(state)
    weight_files = []
    if spec["shards"] == 1:
        save_torch(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        weight_files.append("model.safetensors")
    else:
        n = spec["shards"]
        per = math.ceil(len(names) / n)
        weight_map = {}
        total = 0
        for i in range(n):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            part = {k: state[k] for k in names[i * per : (i + 1) * per]}
            save_torch(part, str(d / fname), metadata={"format": "pt"})
            weight_files.append(fname)
            for k, v in part.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    # Inputs: the model's own processor output for two images, in one call.
    pp = spec["preprocessor"]
    size = pp.get("size") or {"shortest_edge": pp["min_pixels"], "longest_edge": pp["max_pixels"]}
    proc = Qwen2VLImageProcessorPil(
        min_pixels=size["shortest_edge"],
        max_pixels=size["longest_edge"],
        patch_size=pp["patch_size"],
        merge_size=pp["merge_size"],
        temporal_patch_size=pp["temporal_patch_size"],
        image_mean=pp["image_mean"],
        image_std=pp["image_std"],
    )
    imgs = [Image.open(out / "images" / f).convert("RGB") for f in spec["images"]]
    res = proc(images=imgs, return_tensors="pt")
    pixel_values = res["pixel_values"].to(torch.float32).contiguous()
    grid_thw = res["image_grid_thw"].to(torch.int64)
    with torch.no_grad():
        result = model(pixel_values, grid_thw=grid_thw)
    golden = {"pixel_values": pixel_values, "grid_thw": grid_thw, "embeddings": result.pooler_output.float().contiguous()}
    deepstack = getattr(result, "deepstack_features", None) or []
    for j, t in enumerate(deepstack):
        golden[f"deepstack.{j}"] = t.float().contiguous()
    save_torch(golden, str(d / "golden.safetensors"), metadata={"generator": "tools/golden/make_golden.py"})

    verify_checkpoint(d, name, spec, golden)

    merge = pp["merge_size"]
    tokens = [int(t * h * w) // merge**2 for t, h, w in grid_thw.tolist()]
    assert sum(tokens) == golden["embeddings"].shape[0]
    return dict(
        family=name,
        hf_class=type(model).__name__,
        attn_implementation="eager",
        config="config.json",
        config_style="full model (vision_config)" if "vision_config" in spec["config"] else "bare vision config",
        preprocessor_config="preprocessor_config.json",
        weights=weight_files,
        weights_index="model.safetensors.index.json" if spec["shards"] > 1 else None,
        weight_prefix=spec["prefix"],
        weight_dtype=spec["dtype"],
        skipped_tensors=sorted(spec["extra"]),
        vision_tensors=len(model.state_dict()),
        images=[f"images/{f}" for f in spec["images"]],
        golden="golden.safetensors",
        golden_tensors={
            "pixel_values": f"f32 {list(pixel_values.shape)} (processor output, both images concatenated)",
            "grid_thw": f"i64 {list(grid_thw.shape)}",
            "embeddings": f"f32 {list(golden['embeddings'].shape)} (merger output, images in order)",
            **{f"deepstack.{j}": f"f32 {list(t.shape)}" for j, t in enumerate(deepstack)},
        },
        tokens_per_image=tokens,
        note="Weights were rounded to the on-disk dtype and the model then ran in float32 on "
        "exactly those values, so a loader that widens them to f32 sees the same model.",
    )


def verify_checkpoint(d: Path, name: str, spec: dict, golden: dict) -> None:
    """Reload the checkpoint as a reader would (config.json through transformers, weights
    from the files just written, prefix stripped, LM tensors skipped), run it again and require
    the same outputs."""
    from safetensors.torch import load_file

    config = json.loads((d / "config.json").read_text())
    spec2 = dict(spec, config=config)
    model, _ = build_model(name, spec2)
    state = {}
    for f in sorted(d.glob("model*.safetensors")):
        state.update(load_file(str(f)))
    prefix = spec["prefix"]
    vision = {k[len(prefix) :]: v.float() for k, v in state.items() if k.startswith(prefix) and k not in spec["extra"]}
    model.load_state_dict(vision, strict=True)
    with torch.no_grad():
        again = model(golden["pixel_values"], grid_thw=golden["grid_thw"])
    assert torch.equal(again.pooler_output, golden["embeddings"]), f"{name}: reload differs"
    for j, t in enumerate(getattr(again, "deepstack_features", None) or []):
        assert torch.equal(t, golden[f"deepstack.{j}"]), f"{name}: reload deepstack {j} differs"
    # Attention implementation does not matter in f32 beyond rounding.
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        sdpa = model(golden["pixel_values"], grid_thw=golden["grid_thw"]).pooler_output
    rel = ((sdpa - golden["embeddings"]).abs().max() / golden["embeddings"].abs().max()).item()
    assert rel < 1e-5, f"{name}: sdpa vs eager relative difference {rel}"
    print(f"{name}: reload identical, sdpa vs eager max relative difference {rel:.2e}")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # fixed reduction order
    torch.use_deterministic_algorithms(True)

    manifest = {
        "generator": "tools/golden/make_golden.py",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "pillow": PIL.__version__,
            "numpy": np.__version__,
            "safetensors": safetensors.__version__,
        },
        "images": write_images(out),
        "preprocess": write_preprocess(out),
        "models": {name: write_model(out, name, spec) for name, spec in MODELS.items()},
    }
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {str(p.relative_to(out)): dict(bytes=p.stat().st_size, sha256=sha256(p)) for p in files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {len(files) + 1} files, {total / 1024:.0f} KiB, under {out}")


if __name__ == "__main__":
    main()
