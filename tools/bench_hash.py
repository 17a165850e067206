"""Benchmark: file-hash throughput on one core, for choosing the checkpoint integrity record's hash
(checkpoint/integrity.py uses zlib.crc32).

Hashes `--mib` MiB of random bytes in 8 MiB chunks (as `integrity.file_crc32` reads files) with each candidate of
the standard library, and xxhash's xxh3_64 / xxh64 when the `xxhash` package is importable (it is not a dependency);
best of `--repeats`. Prints GB/s per core and the ratio to crc32 measured in the same run; asserts nothing. Usage:
  python tools/bench_hash.py [--mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
import zlib

CHUNK = 8 << 20


def _chunks(data: bytes):
    view = memoryview(data)
    return [view[i : i + CHUNK] for i in range(0, len(data), CHUNK)]


def _candidates() -> dict:
    def checksum(fn):
        def run(chunks):
            value = 0
            for c in chunks:
                value = fn(c, value)
            return value

        return run

    def digest(factory):
        def run(chunks):
            h = factory()
            for c in chunks:
                h.update(c)
            return h.digest()

        return run

    found = {
        "zlib.crc32": checksum(zlib.crc32),
        "zlib.adler32": checksum(zlib.adler32),
        "blake2b-128": digest(lambda: hashlib.blake2b(digest_size=16)),
        "sha1": digest(hashlib.sha1),
        "sha256": digest(hashlib.sha256),
        "md5": digest(hashlib.md5),
    }
    try:
        import xxhash

        found["xxh3_64 (xxhash)"] = digest(xxhash.xxh3_64)
        found["xxh64 (xxhash)"] = digest(xxhash.xxh64)
    except ImportError:
        pass
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = os.urandom(args.mib << 20)
    chunks = _chunks(data)
    rates = {}
    for name, run in _candidates().items():
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            run(chunks)
            best = min(best, time.perf_counter() - start)
        rates[name] = len(data) / best / 1e9
    print(f"{'hash':18} {'GB/s (1 core)':>13} {'vs crc32':>9}")
    for name, rate in rates.items():
        print(f"{name:18} {rate:13.2f} {rate / rates['zlib.crc32']:8.2f}x")


if __name__ == "__main__":
    main()
