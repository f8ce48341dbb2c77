"""Decoding goldens for iris's video loader (core/tests/video_decode.rs): what vLLM 0.33's
`qwen2_vl` and `qwen3_vl` loaders return for the committed clips through their default OpenCV
decoder: the metadata (frame count, fps, duration, indices read) and a blake3 hash of each frame
read (RGB, rows top to bottom).

The clips were made with FFmpeg's lavfi `testsrc2` source:

    ffmpeg -f lavfi -i testsrc2=size=64x48:rate=10 -frames:v 10 -c:v libx264 -pix_fmt yuv420p -g 5 even10.mp4
    ffmpeg -f lavfi -i testsrc2=size=80x60:rate=12 -frames:v 9 -c:v libx264 -pix_fmt yuv420p odd9.mp4
    ffmpeg -f lavfi -i testsrc2=size=64x48:rate=8 -frames:v 12 -c:v libvpx-vp9 -b:v 200k vp9_12.webm

Run from the repository root with the venv of make.py plus opencv-python-headless and blake3:

    python tools/video-goldens/decode.py core/tests/fixtures/video
"""

import json
import sys
from pathlib import Path

import blake3
from vllm.multimodal.video import Qwen2VLVideoBackend, Qwen3VLVideoBackend

folder = Path(sys.argv[1])
goldens = []
for clip in ["even10.mp4", "odd9.mp4", "vp9_12.webm"]:
    data = (folder / clip).read_bytes()
    entry = {"clip": clip}
    for name, backend in [("qwen2_vl", Qwen2VLVideoBackend), ("qwen3_vl", Qwen3VLVideoBackend)]:
        frames, metadata = backend.load_bytes(data)
        entry[name] = {
            "shape": list(frames.shape),
            "frame_hashes": [blake3.blake3(f.tobytes()).hexdigest() for f in frames],
            "metadata": {k: (list(map(int, v)) if k == "frames_indices" else v)
                         for k, v in metadata.items()},
        }
    goldens.append(entry)
(folder / "decode.json").write_text(json.dumps(goldens, indent=1))
print(json.dumps(goldens, indent=1)[:1500])
