#!/usr/bin/env python3
"""Print one F32 tensor of a Lockstep checkpoint shard (safetensors):
read_shard.py FILE TENSOR [N] -> shape, float64 sum, first N (16) elements as float.hex."""
import json, struct, sys
import numpy as np

def load(path, name):
    try:  # the safetensors package's numpy loader, when installed
        from safetensors.numpy import load_file
        return load_file(path)[name]
    except ImportError:  # numpy alone: 8-byte LE header length, JSON header, data
        buf = open(path, "rb").read()
        (n,) = struct.unpack("<Q", buf[:8])
        info = json.loads(buf[8:8 + n])[name]
        b, e = info["data_offsets"]
        return np.frombuffer(buf[8 + n + b:8 + n + e], dtype="<f4").reshape(info["shape"])

t = load(sys.argv[1], sys.argv[2])
print("shape", list(t.shape)); print("sum", float(t.sum(dtype=np.float64)).hex())
for v in t.ravel()[:int(sys.argv[3]) if len(sys.argv) > 3 else 16]: print(float(v).hex())
