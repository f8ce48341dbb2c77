"""Times vLLM 0.33's video loader and transformers' video processor on the clip that
core/benches/video.rs uses (10 s, 1280x720, 30 fps, H.264), per family, as vLLM's encoder runs
them for one video item: the loader (OpenCV decoding and the family's frame sampling), then
the processor. Median of REPEATS runs after one warm-up. Same venv as make.py.

    python tools/video-goldens/speed.py [REPEATS]
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
clip = Path(tempfile.gettempdir()) / "iris-bench-video-720p-10s.mp4"
if not clip.exists():
    sys.exit(f"{clip} is missing: run `cargo bench -p iris-core --bench video` first, which makes it")
data = clip.read_bytes()
print(f"torch threads {torch.get_num_threads()}")

families = [
    # Qwen2.5-VL: the checkpoint's image bounds; Qwen3-VL: its video_preprocessor_config.json.
    ("qwen2.5-vl-7b", Qwen2VLVideoBackend,
     lambda: Qwen2VLVideoProcessor(min_pixels=3136, max_pixels=12845056), {}),
    ("qwen3-vl-8b", Qwen3VLVideoBackend,
     lambda: Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824}),
     {"do_sample_frames": False}),
]
for name, backend, make_processor, kwargs in families:
    processor = make_processor()
    decode_s, process_s = [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        frames, metadata = backend.load_bytes(data)
        mid = time.perf_counter()
        out = processor(videos=[torch.from_numpy(frames)], return_tensors="pt",
                        cap_pixels_per_frame=False, **kwargs)
        end = time.perf_counter()
        if i:
            decode_s.append(mid - start)
            process_s.append(end - mid)
    grid = out["video_grid_thw"][0].tolist()
    print(f"{name}: {len(metadata['frames_indices'])} frames, grid {grid}: loader "
          f"{statistics.median(decode_s) * 1e3:.1f} ms, processor {statistics.median(process_s) * 1e3:.1f} ms, "
          f"together {statistics.median(d + p for d, p in zip(decode_s, process_s)) * 1e3:.1f} ms")
