"""model_fingerprint: which checkpoint a worker serves, cheap enough to compute at start.

    sha256( config.json bytes
            + for each *.safetensors file, by name: name, size, its JSON header )

The header names every tensor with its dtype, shape and byte offsets, so two checkpoints
of one architecture and size differ in it only through their metadata; the sizes and the
config catch the rest of what a mix-up usually is (another model, another dtype, another
fine-tune saved with other metadata). It does not read the weights: a checkpoint edited
in place with byte-identical headers is beyond it (documented in the liveness notes).
"""
from __future__ import annotations

import hashlib
import os
import struct

MAX_HEADER_BYTES = 100 << 20  # safetensors caps its header at 100 MB


def model_fingerprint(model_dir: str) -> str:
    """Hex digest of ``model_dir``'s config and safetensors headers ("" if it has none)."""
    h = hashlib.sha256()
    found = False
    names = sorted(os.listdir(model_dir)) if os.path.isdir(model_dir) else []
    for name in names:
        path = os.path.join(model_dir, name)
        if name == "config.json":
            with open(path, "rb") as f:
                h.update(b"config\0" + f.read())
            found = True
        elif name.endswith(".safetensors"):
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = f.read(min(n, MAX_HEADER_BYTES))
            h.update(f"{name}\0{os.path.getsize(path)}\0".encode() + header)
            found = True
    return h.hexdigest() if found else ""
