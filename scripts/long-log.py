#!/usr/bin/env python3
"""Builds a checkpoint root whose commit log holds N records, for measuring what the
length of the log costs each command (docs/BENCHMARKS.md, "A long commit log").

Records 1 .. N-2 name attempts whose directories are gone (what a log looks like
after checkpoints were removed without their records); records N-1 and N are real
commits of a 256 KiB tensor over 2 ranks, written by `ckpt import`.

    scripts/long-log.py ROOT N CKPT_BINARY
"""
import json
import os
import struct
import subprocess
import sys
import zlib

root, n, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.makedirs(f"{root}/commits", exist_ok=True)
for seq in range(1, n - 1):
    body = json.dumps(
        {"format_version": 2, "step": seq, "generation": 0, "attempt": "g00000000-gone", "world_size": 1},
        separators=(",", ":"),
    ).encode()
    with open(f"{root}/commits/{seq:020}.json", "wb") as f:
        f.write(b'{"crc32":"%08x","body":' % zlib.crc32(body) + body + b"}")
with open(f"{root}/commits/HEAD", "w") as f:
    f.write(str(n - 2))
header = json.dumps({"w": {"dtype": "F32", "shape": [256, 256], "data_offsets": [0, 262144]}}).encode()
header += b" " * ((8 - (8 + len(header)) % 8) % 8)
source = f"{root}.safetensors"
with open(source, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + bytes(262144))
for step in (n - 1, n):
    subprocess.run([ckpt, "import", source, f"file://{root}", "--world-size", "2", "--step", str(step)], check=True)
