#!/usr/bin/env python3
"""Print one F32 tensor of a Lockstep checkpoint shard (safetensors):
read_shard.py FILE TENSOR [N] -> shape, float64 sum, first N (16) elements as float.hex."""
import json, struct, sys
import numpy as np

def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))

def load(path, name):
    n, head = header(path)
    if name not in head:
        # A shard stores pieces: "param/layers.0.wo@0-96" (tensor@global range), not the logical tensor.
        stored = sorted(k for k in head if k != "__metadata__")
        pieces = [k for k in stored if k.split("@")[0] == name]
        hint = ("its pieces here: " + ", ".join(pieces)) if pieces else \
               ("tensors here: " + ", ".join(stored[:12]) + (" ..." if len(stored) > 12 else ""))
        sys.exit(f"read_shard.py: {path} has no tensor '{name}'; {hint}")
    try:  # the safetensors package's numpy loader, when installed
        from safetensors.numpy import load_file
        return load_file(path)[name]
    except ImportError:  # numpy alone: 8-byte LE header length, JSON header, data
        buf = open(path, "rb").read()
        info = head[name]
        b, e = info["data_offsets"]
        return np.frombuffer(buf[8 + n + b:8 + n + e], dtype="<f4").reshape(info["shape"])

if len(sys.argv) < 3:
    sys.exit(__doc__.strip())
t = load(sys.argv[1], sys.argv[2])
print("shape", list(t.shape)); print("sum", float(t.sum(dtype=np.float64)).hex())
for v in t.ravel()[:int(sys.argv[3]) if len(sys.argv) > 3 else 16]: print(float(v).hex())
