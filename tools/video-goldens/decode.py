"""Decoding goldens for iris's video loader (core/tests/video_decode.rs): what vLLM 0.33's
`qwen2_vl` and `qwen3_vl` loaders return for the committed clips through their default OpenCV
decoder: the metadata (frame count, fps, duration, indices read) and a blake3 hash of each frame
read (RGB, rows top to bottom).

The clips were made with FFmpeg's lavfi `testsrc2` source:

    ffmpeg -f lavfi -i testsrc2=size=64x48:rate=10 -frames:v 10 -c:v libx264 -pix_fmt yuv420p -g 5 even10.mp4
    ffmpeg -f lavfi -i testsrc2=size=80x60:rate=12 -frames:v 9 -c:v libx264 -pix_fmt yuv420p odd9.mp4
    ffmpeg -f lavfi -i testsrc2=size=64x48:rate=8 -frames:v 12 -c:v libvpx-vp9 -b:v 200k vp9_12.webm

and, for the cut-clip test of core/tests/video_decode.rs (its index at the front):

    ffmpeg -f lavfi -i testsrc2=size=64x48:rate=10 -frames:v 40 -c:v libx264 -pix_fmt yuv420p -movflags +faststart fast40.mp4

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

# --- Identifiers: vLLM's own ProcessorInputs.get_mm_hashes on the loaders' items ----------
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing.inputs import ProcessorInputs

identifiers = []
factor_sets = [
    ({}, {}),
    ({"video": {"fps": 2}}, {}),
    ({}, {"images_kwargs": {"max_pixels": 3136}}),
    ({"image": {"rgba_background_color": [0, 0, 0]}}, {"videos_kwargs": {"fps": 2}}),
]
for clip in ["even10.mp4", "odd9.mp4", "vp9_12.webm"]:
    data = (folder / clip).read_bytes()
    for backend in ["qwen2_vl", "qwen3_vl"]:
        item = VideoMediaIO(ImageMediaIO(), num_frames=32, video_backend=backend).load_bytes(data)
        for needs_metadata in [False, True]:
            parsed = MultiModalDataParser(video_needs_metadata=needs_metadata).parse_mm_data(
                {"video": [item]})
            for media_io, processor in factor_sets:
                for uuid in [None, "clip-uuid"]:
                    inputs = ProcessorInputs(
                        prompt=[], mm_data_items=parsed,
                        mm_uuid_items={"video": [uuid]} if uuid else None,
                        hf_processor_mm_kwargs=processor, media_io_kwargs=media_io)
                    for algorithm in ["blake3", "sha256"]:
                        identifiers.append({
                            "clip": clip, "loader": backend, "needs_metadata": needs_metadata,
                            "media_io_kwargs": media_io, "mm_processor_kwargs": processor,
                            "uuid": uuid, "algorithm": algorithm, "model_id": "Qwen/Qwen2.5-VL-3B-Instruct",
                            "identifier": inputs.get_mm_hashes("Qwen/Qwen2.5-VL-3B-Instruct", algorithm)["video"][0],
                        })
(folder / "identifiers.json").write_text(json.dumps(identifiers, indent=1))
print(len(identifiers), "identifiers")
