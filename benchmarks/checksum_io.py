"""What checksums add to checkpoint I/O, without a model: one file of ``--gib`` GiB written and read back
through the same paths a save and a load take (``checksum.HashingWriter`` around the file, as ``torch.save``
writes a tensor; ``checksum.read_hashed`` into a buffer), each with and without hashing, alternating, plus
``xxh3_64`` and a plain memory copy alone. On page-cache I/O (no fsync) this is the largest relative cost
a save or load can see::

    python benchmarks/checksum_io.py --dir /tmp/checksum_io --gib 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from lightning_zeroq.checkpoint import checksum


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="folder for the test file (removed at the end)")
    parser.add_argument("--gib", type=float, default=4.0, help="size of the file")
    parser.add_argument("--item-mib", type=int, default=256, help="bytes per write (a tensor item)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-chunk-mib", type=int, nargs="*", default=[],
                        help="also time checked reads with these chunk sizes")
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "data.bin"
    item = torch.randint(0, 255, (args.item_mib << 20,), dtype=torch.uint8).numpy().tobytes()
    items = max(1, int(args.gib * 1024 / args.item_mib))
    total = items * len(item)
    buffer = memoryview(bytearray(total))
    h = checksum.hasher()
    hash_s = _timed(lambda: [h.update(item) for _ in range(items)])
    copy_s = _timed(lambda: [buffer.__setitem__(slice(i * len(item), (i + 1) * len(item)), item) for i in range(items)])

    def write(algorithm):
        with open(path, "wb") as f:
            out = checksum.HashingWriter(f, algorithm)
            for _ in range(items):
                out.write(item)

    def read(algorithm):
        with open(path, "rb") as f:
            fd = f.fileno()
            if algorithm is None:
                got = 0
                while got < total:
                    got += os.preadv(fd, [buffer[got:got + (1 << 30)]], got)
            else:
                checksum.read_hashed(lambda at, view: os.preadv(fd, [view], at), buffer, algorithm)

    rows: dict[str, list[float]] = {k: [] for k in ("write", "write_hashed", "read", "read_hashed")}
    write(None)
    for r in range(args.repeats):
        for name, fn in ([("write", lambda: write(None)), ("write_hashed", lambda: write(checksum.ALGORITHM))]
                         [:: -1 if r % 2 else 1]):
            rows[name].append(_timed(fn))
        for name, fn in ([("read", lambda: read(None)), ("read_hashed", lambda: read(checksum.ALGORITHM))]
                         [:: -1 if r % 2 else 1]):
            rows[name].append(_timed(fn))
    chunks = {}
    for mib in args.read_chunk_mib:
        checksum.READ_CHUNK = mib << 20
        chunks[f"read_hashed_chunk{mib}MiB_s"] = round(statistics.median(
            _timed(lambda: read(checksum.ALGORITHM)) for _ in range(args.repeats)), 3)
    path.unlink()
    med = {k: statistics.median(v) for k, v in rows.items()}
    gib = total / 2**30
    print(json.dumps({
        "GiB": round(gib, 2), "algorithm": checksum.ALGORITHM, "hash_GiB_s": round(gib / hash_s, 2),
        "copy_GiB_s": round(gib / copy_s, 2),
        **{f"{k}_s": round(v, 3) for k, v in med.items()},
        "write_cost_pct": round(100 * (med["write_hashed"] / med["write"] - 1), 1),
        "read_cost_pct": round(100 * (med["read_hashed"] / med["read"] - 1), 1),
        **chunks, **{f"{k}_all": [round(x, 3) for x in v] for k, v in rows.items()},
    }))


if __name__ == "__main__":
    main()
