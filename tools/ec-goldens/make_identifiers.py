#!/usr/bin/env python3
"""Golden item identifiers made by vLLM's own code, replayed by ec/tests/identifiers.rs.

Writes tiny images and cases.json under ec/tests/fixtures/identifiers/. Every image is loaded
through vLLM's MediaConnector/ImageMediaIO (its allowlist, EXIF transpose and mode conversion),
and every identifier comes from ProcessorInputs.get_mm_hashes, the function vLLM's renderer
calls, so the uuid/hash-factor rules are vLLM's and not a re-implementation. For each case the
file records the inputs (kwargs as JSON text, in the order vLLM hashes them), the identifier,
whether vLLM attached an io_config, Pillow's mode, and the decoded RGB picture vLLM's processor
would receive.

Run with the vLLM environment:  ~/venv-vllm/bin/python tools/ec-goldens/make_identifiers.py
"""

import argparse
import hashlib
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

import vllm
from vllm.multimodal.media.connector import MediaConnector, merge_media_io_kwargs
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing.inputs import ProcessorInputs

REPO = Path(__file__).resolve().parents[2]
W, H = 7, 5


def gradient(mode_channels):
    """A deterministic 7x5 picture with distinct values per pixel and channel."""
    y, x = np.mgrid[0:H, 0:W]
    chans = [(x * 37 + y * 11 + c * 71) % 256 for c in range(mode_channels)]
    return np.stack(chans, axis=-1).astype(np.uint8)


def save(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_chunk(kind, data):
    return (
        struct.pack(">I", len(data))
        + kind
        + data
        + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def raw_png(width, height, bit_depth, color_type, rows, extra=b""):
    """A PNG written by hand, for layouts Pillow cannot save (16-bit colour)."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    raw = b"".join(b"\x00" + r for r in rows)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + extra
        + png_chunk(b"IDAT", zlib.compress(raw, 9))
        + png_chunk(b"IEND", b"")
    )


def exif_orientation(value):
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def make_images():
    rgb = Image.fromarray(gradient(3), "RGB")
    rgba_arr = gradient(4)
    rgba_arr[..., 3] = np.array([0, 64, 128, 200, 255, 255, 1])[None, :].repeat(H, 0)
    rgba = Image.fromarray(rgba_arr, "RGBA")
    grey = Image.fromarray(gradient(1)[..., 0], "L")
    la = Image.fromarray(np.stack([gradient(1)[..., 0], rgba_arr[..., 3]], -1), "LA")
    pal = rgb.quantize(colors=8, method=Image.Quantize.MEDIANCUT)
    images = {}
    images["rgb.png"] = save(rgb, "PNG")
    images["rgba.png"] = save(rgba, "PNG")
    images["grey.png"] = save(grey, "PNG")
    images["grey_alpha.png"] = save(la, "PNG")
    images["palette.png"] = save(pal, "PNG")
    images["palette_trns.png"] = save(pal, "PNG", transparency=2)
    images["rgb_trns.png"] = save(rgb, "PNG", transparency=tuple(int(v) for v in gradient(3)[1, 2]))
    images["grey_trns.png"] = save(grey, "PNG", transparency=int(gradient(1)[0, 3, 0]))
    images["bilevel.png"] = save(grey.point(lambda v: 255 if v > 128 else 0).convert("1"), "PNG")
    g16 = (gradient(1)[..., 0].astype(np.uint16) * 257 // 3).astype(">u2")
    images["grey16.png"] = raw_png(W, H, 16, 0, [r.tobytes() for r in g16])
    c16 = (gradient(3).astype(np.uint16) * 259).astype(">u2")
    images["rgb16.png"] = raw_png(W, H, 16, 2, [r.tobytes() for r in c16])
    a16 = (rgba_arr.astype(np.uint16) * 257).astype(">u2")
    images["rgba16.png"] = raw_png(W, H, 16, 6, [r.tobytes() for r in a16])
    images["rgb_exif6.png"] = save(rgb, "PNG", exif=exif_orientation(6))
    images["rgb.jpg"] = save(rgb, "JPEG", quality=90)
    images["grey.jpg"] = save(grey, "JPEG", quality=90)
    images["cmyk.jpg"] = save(Image.fromarray(gradient(4), "CMYK"), "JPEG", quality=90)
    images["rgb_exif6.jpg"] = save(rgb, "JPEG", quality=90, exif=exif_orientation(6))
    images["rgb_exif3.jpg"] = save(rgb, "JPEG", quality=90, exif=exif_orientation(3))
    images["rgb_lossless.webp"] = save(rgb, "WEBP", lossless=True)
    images["rgba_lossless.webp"] = save(rgba, "WEBP", lossless=True)
    images["rgb_lossy.webp"] = save(rgb, "WEBP", quality=80)
    images["palette.gif"] = save(pal, "GIF")
    images["palette_trns.gif"] = save(pal, "GIF", transparency=2)
    images["rgb.bmp"] = save(rgb, "BMP")
    images["rgb.tiff"] = save(rgb, "TIFF")
    images["rgba.tiff"] = save(rgba, "TIFF")
    images["grey.tiff"] = save(grey, "TIFF")
    return images


def identify(data, model_id, algorithm, uuid, mm_kwargs_text, media_io_text, server_media_io):
    """What vLLM's online path does for one image part of a chat request."""
    request_media_io = json.loads(media_io_text) if media_io_text else None
    media_io = merge_media_io_kwargs(server_media_io, request_media_io)
    connector = MediaConnector(media_io_kwargs=media_io)
    loaded = connector._image_io().load_bytes(data)
    items = MultiModalDataParser().parse_mm_data({"image": [loaded]})
    inputs = ProcessorInputs(
        prompt=[],
        mm_data_items=items,
        mm_uuid_items={"image": [uuid]},
        hf_processor_mm_kwargs=json.loads(mm_kwargs_text) if mm_kwargs_text else {},
        media_io_kwargs=media_io or {},
    )
    [identifier] = inputs.get_mm_hashes(model_id, algorithm)["image"]
    return identifier, loaded, media_io


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "ec/tests/fixtures/identifiers")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    images = make_images()
    for name, data in images.items():
        (args.out / name).write_bytes(data)

    models = ["Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen3-VL-2B-Instruct", "/models/qwen2-vl-7b"]
    algorithms = ["blake3", "sha256", "sha512"]
    cases = []

    def add(name, file, model=0, algorithm="blake3", uuid=None, mm=None, media=None, server=None):
        data = images[file]
        identifier, loaded, media_io = identify(
            data, models[model], algorithm, uuid, mm, media, server
        )
        opened = Image.open(io.BytesIO(data))
        picture = np.asarray(loaded.media)
        assert picture.dtype == np.uint8 and picture.shape[2] == 3, picture.shape
        cases.append(
            {
                "name": name,
                "file": file,
                "model_id": models[model],
                "algorithm": algorithm,
                "uuid": uuid,
                "mm_processor_kwargs": mm,
                "media_io_kwargs": media,
                "server_media_io_kwargs": json.dumps(server) if server else None,
                "effective_media_io_kwargs": json.dumps(media_io) if media_io else None,
                "expected": identifier,
                "io_config": loaded.io_config is not None,
                "background": list(
                    (loaded.io_config or {}).get("rgba_background_color", (255, 255, 255))
                ),
                "pillow_format": opened.format,
                "pillow_mode": opened.mode,
                "decoded_size": [loaded.media.width, loaded.media.height],
                "decoded_rgb_sha256": hashlib.sha256(picture.tobytes()).hexdigest(),
                "decoded_rgb_hex": picture.tobytes().hex(),
            }
        )

    # Every image, hashed from its bytes, cycling through algorithms and model ids.
    for i, file in enumerate(images):
        add(f"bytes/{file}", file, model=i % 3, algorithm=algorithms[i % 3])
    # The uuid rules: verbatim without factors; hashed in place of the bytes with them.
    add("uuid/plain", "rgb.png", uuid="cat-0001")
    add("uuid/converted_image", "rgba.png", uuid="cat-0002")
    add("uuid/empty_kwargs", "rgba.png", uuid="cat-0003", mm="{}", media="{}")
    add("uuid/empty_image_media_io", "rgb.png", uuid="u", media='{"image": {}}')
    add("uuid/video_only_factors", "rgb.png", uuid="u", mm='{"videos_kwargs": {"fps": 2}}',
        media='{"video": {"num_frames": 8}}')
    add("uuid/processor_kwargs", "rgb.png", uuid="cat-0004",
        mm='{"max_pixels": 1003520, "min_pixels": 3136}')
    add("uuid/processor_kwargs_other_order", "rgb.png", uuid="cat-0004",
        mm='{"min_pixels": 3136, "max_pixels": 1003520}')
    add("uuid/processor_kwargs_sha512", "rgba.png", model=1, algorithm="sha512", uuid="cat-0005",
        mm='{"images_kwargs": {"max_pixels": 50176}, "do_resize": true, "scale": 0.5, "tag": null}')
    add("uuid/empty_images_kwargs", "rgb.png", uuid="u", mm='{"images_kwargs": {}}')
    add("uuid/media_io_kwargs", "grey.png", algorithm="sha256", uuid="u-media",
        media='{"image": {"rgba_background_color": [0, 0, 0]}}')
    add("uuid/server_media_io_kwargs", "rgb.png", uuid="u-server",
        server={"image": {"rgba_background_color": [10, 20, 30]}})
    add("uuid/utf8", "rgb.png", uuid="chat-\u00e9\u4e2d-1", mm='{"max_pixels": 200704}')
    # Factors with bytes.
    add("bytes/processor_kwargs", "rgb.png", model=2, mm='{"max_pixels": 1003520}')
    add("bytes/processor_kwargs_rgba", "rgba.png", algorithm="sha256",
        mm='{"min_pixels": 784, "max_pixels": 12845056, "nested": [1, 2.5, "x", {"k": false}]}')
    add("bytes/black_background", "rgba.png",
        media='{"image": {"rgba_background_color": [0, 0, 0]}}')
    add("bytes/coloured_background_trns", "palette_trns.png", algorithm="sha512",
        media='{"image": {"rgba_background_color": [12, 200, 99]}}')
    add("bytes/server_background_rgb", "rgb.png",
        server={"image": {"rgba_background_color": [0, 0, 0]}})
    add("bytes/server_and_request_media_io", "grey_alpha.png",
        server={"image": {"rgba_background_color": [0, 0, 255]}},
        media='{"image": {"rgba_background_color": [255, 0, 0]}}')

    manifest = {
        "generator": "tools/ec-goldens/make_identifiers.py",
        "versions": {
            "vllm": vllm.__version__,
            "pillow": PIL.__version__,
            "numpy": np.__version__,
        },
        "cases": cases,
    }
    text = json.dumps(manifest, indent=1, ensure_ascii=False) + "\n"
    (args.out / "cases.json").write_text(text, encoding="utf-8")
    total = sum(len(d) for d in images.values())
    print(f"{len(cases)} cases, {len(images)} images ({total} bytes) in {args.out}")


if __name__ == "__main__":
    main()
