"""What checkpoint checksums (trainer/checkpoint/checksums.py) cost: MB/s per core of the standard
library's digests over random bytes, and of kiln's file_checksum over a file in the page cache.

    python benchmarks/checksum_rate.py [--mib 256]

Rates are per CPU-second (time.process_time): on shared cores the wall clock measures the other jobs. Best of 3.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.checkpoint.checksums import file_checksum  # noqa: E402

PIECE = 8 << 20  # as file_checksum reads


def best_rate(fn: Callable[[], object], n_bytes: int) -> float:
    """MB/s per CPU-second of fn over n_bytes, best of 3."""
    times = []
    for _ in range(3):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return n_bytes / min(times) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes hashed, in MiB (the file is 4x that)")
    n = parser.parse_args().mib << 20
    data = memoryview(os.urandom(n))

    def crc32() -> int:
        crc = 0
        for i in range(0, n, PIECE):
            crc = zlib.crc32(data[i : i + PIECE], crc)
        return crc

    def digest(name: str) -> Callable[[], str]:
        def run() -> str:
            h = hashlib.new(name)
            for i in range(0, n, PIECE):
                h.update(data[i : i + PIECE])
            return h.hexdigest()

        return run

    digests = {"zlib.crc32": crc32, "hashlib.sha256": digest("sha256"), "hashlib.blake2b": digest("blake2b")}
    for name, fn in digests.items():
        print(f"{name:16s} {best_rate(fn, n):8,.0f} MB/s per core")
    with tempfile.NamedTemporaryFile(suffix=".distcp") as f:
        for _ in range(4):
            f.write(data)
        f.flush()
        file_checksum(f.name)  # into the page cache
        print(
            f"{'file_checksum':16s} {best_rate(lambda: file_checksum(f.name), 4 * n):8,.0f} MB/s per core (page cache)"
        )


if __name__ == "__main__":
    main()
