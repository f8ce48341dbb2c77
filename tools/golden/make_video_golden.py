#!/usr/bin/env python3
"""Video goldens for the three towers: transformers' vision models, loaded from the committed
random-weight checkpoints in tests/data/golden/<family>/ (as make_golden.py made them), run on a
video's pixel values: five synthetic frames (an odd count, so the last frame is repeated into a
third temporal group) through the family's video processor (`Qwen2VLVideoProcessor` for Qwen2-VL
and Qwen2.5-VL, `Qwen3VLVideoProcessor` for Qwen3-VL) with the checkpoint's patch geometry and
normalization. Writes tests/data/golden/video/<family>.safetensors (beside, not in, the
checkpoint folder, whose every safetensors file a weight loader reads): `frames` (u8 [5, H, W, 3]),
`pixel_values` (f32), `grid_thw` (i64 [1, 3]), `embeddings` and, for Qwen3-VL, `deepstack.<j>`.

core/tests/golden_towers.rs runs iris's towers on the same pixel values: a video's temporal groups
are attention segments of their own, with positions repeated per group, as transformers has them.

Run from the repository root with the Python of make_golden.py (torch, transformers,
safetensors, numpy, pillow); each file's metadata records the torch and transformers versions
it was made with:

    python tools/golden/make_video_golden.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import MODELS, OUT, build_model  # noqa: E402

FRAMES = 5
# Frame size in merge units (rows, columns): Qwen2.5-VL's is wider than its 4-unit windows, so
# each temporal group holds a whole window and a ragged one.
UNITS = {"qwen2_vl": (2, 3), "qwen2_5_vl": (2, 5), "qwen3_vl": (2, 3)}


def frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    """Gradients with hard edges, moving from frame to frame, and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    out = []
    for f in range(n):
        base = np.stack(
            [(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y + 9 * f) * 7) % 256], axis=-1
        ).astype(np.int32)
        base[(x // 7 + y // 5 + f) % 3 == 0] //= 3
        out.append(np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8))
    return np.stack(out)


def processor(name: str, d: Path):
    """The family's video processor with the checkpoint's geometry and normalization."""
    config = json.loads((d / "config.json").read_text())
    vision = config.get("vision_config", config)
    pp = json.loads((d / "preprocessor_config.json").read_text())
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    unit = patch * merge
    rows, cols = UNITS[name]
    common = dict(
        patch_size=patch,
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=merge,
        image_mean=pp["image_mean"],
        image_std=pp["image_std"],
    )
    if name == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        # One budget over all frames.
        size = {"shortest_edge": unit * unit, "longest_edge": unit * unit * rows * cols * FRAMES}
        return Qwen3VLVideoProcessor(size=size, **common), dict(do_sample_frames=False, cap_pixels_per_frame=False)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": unit * unit, "longest_edge": unit * unit * rows * cols}
    # No per-frame cap (transformers' default before 5.22, and what vLLM 0.33 runs with).
    return Qwen2VLVideoProcessor(size=size, **common), dict(cap_pixels_per_frame=False)


def main() -> None:
    (OUT / "video").mkdir(exist_ok=True)
    for name, spec in MODELS.items():
        d = OUT / name
        model, _ = build_model(name, dict(spec, config=json.loads((d / "config.json").read_text())))
        state = {}
        for f in sorted(d.glob("model*.safetensors")):
            state.update(load_file(str(f)))
        prefix = spec["prefix"]
        model.load_state_dict(
            {k[len(prefix) :]: v.float() for k, v in state.items() if k.startswith(prefix) and k not in spec["extra"]},
            strict=True,
        )
        proc, kwargs = processor(name, d)
        unit = proc.patch_size * proc.merge_size
        rows, cols = UNITS[name]
        video = frames(FRAMES, rows * unit, cols * unit, seed=len(name))
        res = proc(videos=[torch.from_numpy(video)], return_tensors="pt", **kwargs)
        pixel_values = res["pixel_values_videos"].to(torch.float32).contiguous()
        grid_thw = res["video_grid_thw"].to(torch.int64)
        want = [[3, rows * proc.merge_size, cols * proc.merge_size]]
        assert grid_thw.tolist() == want, f"{name}: grid {grid_thw.tolist()}, want {want}"
        with torch.no_grad():
            result = model(pixel_values, grid_thw=grid_thw)
        golden = {
            "frames": torch.from_numpy(video),
            "pixel_values": pixel_values,
            "grid_thw": grid_thw,
            "embeddings": result.pooler_output.float().contiguous(),
        }
        for j, t in enumerate(getattr(result, "deepstack_features", None) or []):
            golden[f"deepstack.{j}"] = t.float().contiguous()
        save_file(
            golden,
            str(OUT / "video" / f"{name}.safetensors"),
            metadata={"transformers": transformers.__version__, "torch": torch.__version__},
        )
        shapes = {k: list(v.shape) for k, v in golden.items()}
        print(f"{name}: {shapes}")


if __name__ == "__main__":
    main()
