"""What fingerprinting a data folder costs at every start (ddp_accel.identity.source_fingerprint): a synthetic
ImageFolder of many small files, timed by content (every byte hashed) and by its sampled form (every path and size,
the content of 1 file in k), and extrapolated per file to ImageNet's 1.28 million.

    python benchmarks/fingerprint.py --files 200000 --size 4096

The folder is written once (train/ and val/, 1,000 class folders); the page cache is warm, as it is on the second
start of a job on one machine (a cold network file system is slower: measure there with --folder). ImageNet's
estimate: its 1.33 million paths and sizes at the measured rate, plus CONTENT_LIMIT bytes hashed at the measured
speed (a folder above CONTENT_LIMIT reads about that much).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from ddp_accel.identity import CONTENT_LIMIT, source_fingerprint

IMAGENET_FILES = 1_281_167 + 50_000


def make_folder(root: Path, files: int, size: int) -> None:
    payload = os.urandom(size)
    for split in ("train", "val"):
        for label in range(1000):
            (root / split / f"n{label:08d}").mkdir(parents=True)
    for index in range(files):
        split = "val" if index % 26 == 0 else "train"
        folder = root / split / f"n{index % 1000:08d}"
        (folder / f"{index}.JPEG").write_bytes(payload[index % 64 :] + payload[: index % 64])


def timed(folder: Path, content_limit: int) -> tuple[float, str]:
    started = time.perf_counter()
    fingerprint = source_fingerprint(folder, content_limit=content_limit)
    return time.perf_counter() - started, fingerprint or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=4096, help="bytes per file")
    parser.add_argument("--folder", type=Path, help="an existing folder to time instead of a synthetic one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.folder or Path(temporary) / "images"
        if args.folder is None:
            started = time.perf_counter()
            make_folder(folder, args.files, args.size)
            print(f"wrote {args.files:,} files of {args.size:,} bytes in {time.perf_counter() - started:.0f} s")
        files = sum(1 for path in folder.rglob("*") if path.is_file())
        total = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
        content_s, _ = timed(folder, total + 1)  # every byte hashed
        listing_s, fingerprint = timed(folder, 1)  # every path and size, one file's content
        listing_us = listing_s / files * 1e6
        hash_mb_s = total / 1e6 / max(content_s - listing_s, 1e-9)
        # ImageNet: every path and size, and about CONTENT_LIMIT bytes of sampled content
        imagenet_s = listing_us * IMAGENET_FILES / 1e6 + CONTENT_LIMIT / 1e6 / hash_mb_s
        print(
            json.dumps(
                {
                    "files": files,
                    "bytes": total,
                    "by_content_s": round(content_s, 2),
                    "paths_and_sizes_s": round(listing_s, 2),
                    "us_per_file_listed": round(listing_us, 1),
                    "hashed_mb_per_s": round(hash_mb_s),
                    "imagenet_estimate_s": round(imagenet_s, 1),
                    "fingerprint": fingerprint,
                }
            )
        )


if __name__ == "__main__":
    main()
