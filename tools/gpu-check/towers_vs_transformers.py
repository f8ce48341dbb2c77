#!/usr/bin/env python3
"""Vision towers in bf16 on one GPU: iris's CUDA device against transformers.

Towers: Qwen2-VL-2B and Qwen2.5-VL-7B, random weights on both sides (the machine has no model
download), built from their published vision hyperparameters. transformers runs with its best
attention: flash_attention_2 when the flash-attn package is installed, else sdpa. Inputs: one
448x448 image (1024 patches) and a batch of four, preprocessed by transformers' Qwen2-VL image
processor; iris encodes the same image file.

Times: transformers' model call between two torch.cuda.synchronize() calls; iris's time as
`iris encode --device cuda` prints it (upload, tower, read-back; weights already resident).
Each side's median over --repeats runs after one warm-up. The goal in docs/PERFORMANCE.md is
iris at least as fast as transformers.

Usage (from the repository root; called by tools/gpu-check.sh):
    python3 tools/gpu-check/towers_vs_transformers.py --iris target/release/iris --repeats 5
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

IMAGE = 448

TOWERS = {
    "qwen2-vl-2b": {
        "module": "qwen2_vl",
        "config": "Qwen2VLVisionConfig",
        "model": "Qwen2VisionTransformerPretrainedModel",
        "params": dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    },
    "qwen2.5-vl-7b": {
        "module": "qwen2_5_vl",
        "config": "Qwen2_5_VLVisionConfig",
        "model": "Qwen2_5_VisionTransformerPretrainedModel",
        "params": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
    },
}


def attention_implementation():
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return "sdpa"


def build(tower, attention):
    import importlib

    import torch

    spec = TOWERS[tower]
    configs = importlib.import_module(f"transformers.models.{spec['module']}.configuration_{spec['module']}")
    models = importlib.import_module(f"transformers.models.{spec['module']}.modeling_{spec['module']}")
    config = getattr(configs, spec["config"])(**spec["params"])
    config._attn_implementation = attention
    cls = getattr(models, spec["model"])
    torch.manual_seed(0)
    try:
        model = cls._from_config(config, dtype=torch.bfloat16)
    except TypeError:  # transformers before the `dtype` keyword
        model = cls._from_config(config, torch_dtype=torch.bfloat16)
    return model.to("cuda").eval()


def make_image(path):
    from PIL import Image

    pixels = bytes(((x * 7 + y * 3) % 256) for y in range(IMAGE) for x in range(IMAGE) for _ in range(3))
    Image.frombytes("RGB", (IMAGE, IMAGE), pixels).save(path)


def inputs(image_path, count):
    import torch
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor()
    image = Image.open(image_path).convert("RGB")
    out = processor(images=[image] * count, return_tensors="pt")
    return out["pixel_values"].to("cuda", torch.bfloat16), out["image_grid_thw"].to("cuda")


def time_transformers(model, batch):
    import torch

    pixels, grid = batch
    with torch.inference_mode():
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(pixels, grid_thw=grid)
        torch.cuda.synchronize()
        return time.perf_counter() - start


def time_iris(iris, tower, image_path, count, out_dir):
    args = [iris, "encode", "--device", "cuda", "--model", tower, "--weights", "dummy", "--dtype", "bf16",
            "--out", os.path.join(out_dir, "out.safetensors")]
    if count > 1:
        args.append("--batch")
    args += [image_path] * count
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"iris failed:\n{result.stdout}\n{result.stderr}")
    times = re.findall(r"(?:batch of \d+ in )?([0-9.]+) s$", result.stdout, flags=re.M)
    if not times:
        sys.exit(f"cannot read iris's time from:\n{result.stdout}")
    # One line per image; a batch prints the same time on each line, single images one each.
    return float(times[-1]) if count > 1 else sum(float(t) for t in times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iris", default="target/release/iris")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    import torch

    attention = attention_implementation()
    gpu = torch.cuda.get_device_name(0)
    results = {"gpu": gpu, "attention": attention, "repeats": args.repeats, "towers": {}}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        image = os.path.join(tmp, "image.png")
        make_image(image)
        for tower in TOWERS:
            model = build(tower, attention)
            cases = {1: inputs(image, 1), 4: inputs(image, 4)}
            time_transformers(model, cases[1])
            time_iris(args.iris, tower, image, 1, tmp)
            for count, batch in cases.items():
                hf = [time_transformers(model, batch) for _ in range(args.repeats)]
                ours = [time_iris(args.iris, tower, image, count, tmp) for _ in range(args.repeats)]
                t_hf, t_iris = statistics.median(hf), statistics.median(ours)
                results["towers"].setdefault(tower, {})[count] = {
                    "transformers_s": t_hf, "iris_s": t_iris, "speedup": t_hf / t_iris}
                print(f"{tower}, {count} image(s): transformers ({attention}) {t_hf * 1e3:.1f} ms, "
                      f"iris {t_iris * 1e3:.1f} ms, iris is {t_hf / t_iris:.2f}x transformers' speed", flush=True)
                failed |= t_iris > t_hf
            del model
            torch.cuda.empty_cache()
    print(f"\nGPU {gpu}; transformers attention: {attention}")
    print("| tower | images | transformers ms | iris ms | transformers / iris |")
    print("|---|---|---|---|---|")
    for tower, cases in results["towers"].items():
        for count, r in cases.items():
            print(f"| {tower} | {count} | {r['transformers_s'] * 1e3:.1f} | {r['iris_s'] * 1e3:.1f} | {r['speedup']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    # The goal is iris at least as fast as transformers; slower is reported as a failure.
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
