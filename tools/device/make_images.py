#!/usr/bin/env python3
"""Writes the images benchmark's requests (tools/device/run.sh step images27), one JSON request a line.

    python3 tools/device/make_images.py N FIRST OUT.jsonl

Request k (k = FIRST .. FIRST+N-1) holds 8 video frames of 640x360 (PNG, base64; a scene of gradients
with a disk moving 40 px right a frame, its colours and start drawn from seed k, so every request has
images of its own and none is a prefix-cache hit) and 24 questions about them (choice and noul, the
evidence placed first: `state` is a short text). Python's standard library only (zlib for the PNGs):
the GPU machine may have no PIL.
"""
import base64
import json
import random
import struct
import sys
import zlib

WIDTH, HEIGHT, FRAMES, QUESTIONS = 640, 360, 8, 24


def png(rgb: bytes, width: int, height: int) -> bytes:
    """An 8-bit RGB PNG of `rgb` (rows top to bottom)."""
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def frame(seed: int, index: int) -> bytes:
    rng = random.Random(seed)
    base = [rng.randrange(40, 200) for _ in range(3)]
    disk = [rng.randrange(0, 256) for _ in range(3)]
    x0, y0, radius = rng.randrange(40, 200), rng.randrange(80, 280), rng.randrange(25, 60)
    cx = x0 + 40 * index
    rows = []
    for y in range(HEIGHT):
        row = bytearray(WIDTH * 3)
        g = (y * 96) // HEIGHT
        for x in range(WIDTH):
            dx, dy = x - cx, y - y0
            if dx * dx + dy * dy <= radius * radius:
                r, gg, b = disk
            else:
                r = (base[0] + (x * 64) // WIDTH) & 255
                gg = (base[1] + g) & 255
                b = (base[2] + ((x // 80 + y // 60) % 2) * 40) & 255
            row[3 * x:3 * x + 3] = bytes((r, gg, b))
        rows.append(bytes(row))
    return png(b"".join(rows), WIDTH, HEIGHT)


def questions() -> dict:
    out = {}
    for q in range(QUESTIONS):
        if q % 3 == 2:
            out[f"q{q:02d}"] = {"type": "noul", "instructions": f"Is object {q} visible in the last frame?"}
        else:
            out[f"q{q:02d}"] = {
                "type": "choice",
                "instructions": f"Question {q}: where does the disk go over the frames?",
                "criteria": {"left": "it moves left", "right": "it moves right", "still": "it does not move"},
            }
    return out


def main() -> None:
    n, first, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with open(path, "w") as out:
        for k in range(first, first + n):
            images = [base64.b64encode(frame(k, i)).decode() for i in range(FRAMES)]
            request = {
                "state": f"Camera {k}: eight frames of the loading dock, one a second.",
                "images": images,
                "questions": questions(),
            }
            out.write(json.dumps(request) + "\n")
    print(f"make_images: {n} requests of {FRAMES} frames {WIDTH}x{HEIGHT} and {QUESTIONS} questions in {path}")


if __name__ == "__main__":
    main()
