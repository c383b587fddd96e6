"""Real processes for tests/test_shm_ring.py: ring readers, and writers to crash or churn.

Input and output are JSON lines (msgspec): nothing is pickled.

  python shm_worker.py reader <segment name>   stdin: [key, ref] lines; stdout: digest lines
                                               ("gone" when the entry was overwritten)
  python shm_worker.py writer <capacity>       prints the segment name, then waits for stdin
                                               to close (or for kill -9)
  python shm_worker.py churn <capacity> <n>    writes entries 0, 1, 2, ... (1 MiB each, all
                                               bytes = i % 251) round the ring, printing
                                               [key, ref] lines, until stdin closes
"""
from __future__ import annotations

import hashlib
import sys

import msgspec
import torch

from triptych.mmcache.shm_ring import ShmEntryOverwritten, ShmItemRef, ShmRingReader, ShmRingWriter

torch.set_num_threads(1)
Line = tuple[str, ShmItemRef]


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def reader(name: str) -> None:
    r = ShmRingReader(name)
    dec = msgspec.json.Decoder(Line)
    for raw in sys.stdin:
        key, ref = dec.decode(raw)
        try:
            print(digest(r.read(ref, key)), flush=True)
        except ShmEntryOverwritten:
            print("gone", flush=True)
    r.close()


def writer(capacity: int) -> None:
    w = ShmRingWriter(capacity)
    print(w.name, flush=True)
    sys.stdin.read()  # until the test closes stdin (or kills us)
    w.close()


def churn(capacity: int, n: int) -> None:
    import select

    w = ShmRingWriter(capacity)
    print(w.name, flush=True)
    enc = msgspec.json.Encoder()
    i = 0
    while not select.select([sys.stdin], [], [], 0)[0]:  # stdin closed -> readable (EOF)
        ref = w.put(f"k{i}", torch.full((n,), i % 251, dtype=torch.uint8).view(torch.float32))
        if ref is not None:
            try:
                sys.stdout.write(enc.encode((f"k{i}", ref)).decode() + "\n")
                sys.stdout.flush()
            except BrokenPipeError:  # the test stopped listening: done
                break
        i += 1
    w.close()
    sys.stdout = None  # nothing left to flush into a closed pipe at exit


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "reader":
        reader(sys.argv[2])
    elif mode == "writer":
        writer(int(sys.argv[2]))
    else:
        churn(int(sys.argv[2]), int(sys.argv[3]))
