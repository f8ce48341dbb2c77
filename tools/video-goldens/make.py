"""Goldens for iris's video sampling and processing (core/tests/video_goldens.rs).

Frame indices come from vLLM 0.33's own loaders (`Qwen2VLVideoBackend`,
`Qwen3VLVideoBackend.compute_frames_index_to_sample`), timestamps from its Qwen3-VL processing
info, and pixel values from transformers 5.24's `Qwen2VLVideoProcessor` and
`Qwen3VLVideoProcessor` on synthetic frames, resized on the CPU (PyTorch's uint8 antialiased
bicubic). Run from the repository root with a venv holding vllm==0.33.0 (--no-deps plus the
modules it imports), transformers==5.24.0, torch, torchvision and safetensors:

    python tools/video-goldens/make.py core/tests/fixtures/video
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend
from vllm.multimodal.video_decoders.base import VideoSourceMetadata, VideoTargetMetadata

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)

# --- Sampling: (total frames, source fps, requested fps) ---------------------------------------
cases = []
for total, src_fps, fps in [
    (300, 30.0, 2), (45, 10.0, 2), (451, 29.97, 2), (2, 30.0, 2), (3, 24.0, 2), (5, 25.0, 2),
    (9, 3.0, 2), (17, 1.0, 2), (100, 23.976, 1), (1000, 60.0, 5), (1500, 30.0, 40),
    (77, 12.5, 0.5), (4000, 30.0, 2), (250, 7.0, 3), (13, 29.97, 2), (1, 30.0, 2),
    (60, 0.0, 2), (999, 29.97, 30),
]:
    source = VideoSourceMetadata(total, src_fps, total / src_fps if src_fps else 0.0)
    target = VideoTargetMetadata(num_frames=-1, fps=fps, max_duration=300)
    case = {"total": total, "source_fps": src_fps, "fps": fps}
    for name, backend in [("qwen2_vl", Qwen2VLVideoBackend), ("qwen3_vl", Qwen3VLVideoBackend)]:
        try:
            case[name] = [int(i) for i in backend.compute_frames_index_to_sample(source, target)]
        except Exception as err:  # the loader refuses: iris must refuse too
            case[name] = {"error": type(err).__name__}
    cases.append(case)

# --- Qwen3-VL timestamps ---------------------------------------------------------------------
from vllm.model_executor.models.qwen3_vl import Qwen3VLProcessingInfo

timestamps = []
for indices, src_fps in [([0, 6, 11, 16, 22, 28, 33, 38, 44], 10.0), ([0, 16, 31, 47], 29.97),
                         ([0, 1, 2], 24.0), (list(range(0, 300, 15)), 30.0)]:
    ts = Qwen3VLProcessingInfo._calculate_timestamps(None, indices, src_fps, 2)
    timestamps.append({"indices": indices, "source_fps": src_fps, "timestamps": ts})

(out / "sampling.json").write_text(json.dumps({"cases": cases, "timestamps": timestamps}, indent=1))


# --- Processors ------------------------------------------------------------------------------
def frames(n, h, w, seed):
    """Smooth gradients with noise and hard edges: resampling differences show at edges."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    out = []
    for f in range(n):
        base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                         ((x + y + 9 * f) * 7) % 256], axis=-1).astype(np.int32)
        base[(x // 7 + y // 5 + f) % 3 == 0] //= 3
        noise = rng.integers(-20, 21, base.shape)
        out.append(np.clip(base + noise, 0, 255).astype(np.uint8))
    return np.stack(out)


tensors = {}
meta = []
specs = [
    # name, processor, frames, h, w, size
    ("qwen2_odd", "qwen2", 5, 50, 70, {"shortest_edge": 3136, "longest_edge": 28 * 28 * 12}),
    ("qwen2_even_up", "qwen2", 4, 30, 90, {"shortest_edge": 3136, "longest_edge": 28 * 28 * 30}),
    ("qwen2_mixed", "qwen2", 2, 37, 91, {"shortest_edge": 3136, "longest_edge": 28 * 28 * 30}),
    ("qwen3_odd", "qwen3", 5, 64, 90, {"shortest_edge": 4096, "longest_edge": 32 * 32 * 2 * 6}),
    ("qwen3_even", "qwen3", 6, 120, 50, {"shortest_edge": 4096, "longest_edge": 32 * 32 * 6 * 4}),
    ("qwen3_small", "qwen3", 3, 20, 45, {"shortest_edge": 32 * 32 * 4 * 4, "longest_edge": 10**7}),
]
for i, (name, kind, n, h, w, size) in enumerate(specs):
    video = frames(n, h, w, i)
    if kind == "qwen2":
        proc = Qwen2VLVideoProcessor(size=size)
        result = proc(videos=[torch.from_numpy(video)], return_tensors="np",
                      cap_pixels_per_frame=False)
    else:
        proc = Qwen3VLVideoProcessor(size=size)
        result = proc(videos=[torch.from_numpy(video)], return_tensors="np",
                      do_sample_frames=False, cap_pixels_per_frame=False)
    tensors[f"{name}.frames"] = video
    tensors[f"{name}.pixel_values"] = result["pixel_values_videos"].astype(np.float32)
    meta.append({"name": name, "processor": kind, "size": size,
                 "grid_thw": [int(v) for v in result["video_grid_thw"][0]]})
save_file(tensors, str(out / "processors.safetensors"))
(out / "processors.json").write_text(json.dumps(meta, indent=1))
print("wrote", out, torch.backends.cpu.get_cpu_capability())
