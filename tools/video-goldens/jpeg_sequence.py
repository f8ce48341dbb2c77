"""Goldens for JPEG frame lists (`data:video/jpeg;base64,F1,F2,...`), the third way vLLM 0.33
takes a video: three small JPEG frames made here with Pillow, what vLLM's `VideoMediaIO`
decodes from them under several `media_io_kwargs.video` (the frames, metadata), and
the identifier its own `ProcessorInputs.get_mm_hashes` gives each case.

Run from the repository root with the venv of make.py:

    python tools/video-goldens/jpeg_sequence.py core/tests/fixtures/video
"""

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing.inputs import ProcessorInputs

folder = Path(sys.argv[1])
parts = []
for k in range(3):
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([(x * 4 + k * 40) % 256, (y * 5) % 256, ((x + y) * 3 + k * 70) % 256], -1)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buffer, "JPEG", quality=90)
    parts.append(base64.b64encode(buffer.getvalue()).decode())
payload = ",".join(parts)

model_id = "Qwen/Qwen2.5-VL-3B-Instruct"
cases = []
for media_io in [
    {},
    {"fps": 2},
    {"num_frames": 2},
    {"fps": 4.0, "frames_indices": [0, 4, 8], "total_num_frames": 12, "duration": 3.0},
]:
    item = VideoMediaIO(ImageMediaIO(), **({"num_frames": 32} | media_io)).load_base64(
        "video/jpeg", payload)
    frames, metadata = item.media
    factors = {"video": media_io} if media_io else {}
    identifiers = {}
    for needs_metadata in [False, True]:
        parsed = MultiModalDataParser(video_needs_metadata=needs_metadata).parse_mm_data(
            {"video": [item]})
        inputs = ProcessorInputs(prompt=[], mm_data_items=parsed, mm_uuid_items=None,
                                 hf_processor_mm_kwargs={}, media_io_kwargs=factors)
        identifiers[str(needs_metadata)] = inputs.get_mm_hashes(model_id, "blake3")["video"][0]
    assert identifiers["False"] == identifiers["True"]
    cases.append({
        "media_io_kwargs": factors,
        # The same as text, in Python's key order (vLLM hashes nested dicts in their order).
        "media_io_kwargs_json": json.dumps(factors),
        "model_id": model_id,
        "shape": list(frames.shape),
        # Pillow's pixels: iris's JPEG decoder is within 2 levels of libjpeg-turbo's.
        "frames": base64.b64encode(np.ascontiguousarray(frames).tobytes()).decode(),
        "metadata": metadata,
        "identifier": identifiers["False"],
    })
(folder / "jpeg_sequence.json").write_text(json.dumps({"payload": payload, "cases": cases}, indent=1))
print(json.dumps(cases, indent=1)[:3000])
