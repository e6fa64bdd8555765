"""Decode TinyImageNet once into memory-mapped uint8 arrays: the input of --data-cache.

Decoding 100,000 JPEGs with PIL every epoch keeps a GPU waiting; decoded once, a batch is one
read from a memory map. Run it once per node (the Slurm launchers do, before torchrun), or let
the first training run with --data-cache build it on each node's local rank 0:

    python prepare_tinyimagenet.py /data/tiny-imagenet-200                # beside the data
    python prepare_tinyimagenet.py /data/tiny-imagenet-200 /scratch/tin-cache
    torchrun --nproc-per-node 4 ddp_train.py --data-dir /data/tiny-imagenet-200 --data-cache

It writes, per split, {split}_u8.npy (N x 64 x 64 x 3), {split}_labels.npy and
{split}_meta.json; common.CachedSplit reads them. The meta file holds a checksum of the file
list (names, labels, sizes): when the dataset changes the cache is rebuilt, otherwise reused.
Unreadable images are left out and counted (--strict: stop and name the first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

import common
from common import UsageError

CACHE_VERSION = 1
SPLITS = ("train", "val")


def default_cache_dir(data_dir) -> Path:
    """Beside the data (tiny-imagenet-200 -> tiny-imagenet-200-cache) when that is writable,
    else under the user's cache dir."""
    data_dir = Path(data_dir).resolve()
    beside = data_dir.parent / f"{data_dir.name}-cache"
    if (beside.is_dir() and os.access(beside, os.W_OK)) or \
            (not beside.exists() and os.access(data_dir.parent, os.W_OK)):
        return beside
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = hashlib.sha256(str(data_dir).encode()).hexdigest()[:12]
    return base / "dp-toolkit" / f"{data_dir.name}-{tag}"


def cache_dir(data_dir, choice) -> Path:
    """--data-cache DIR, or with no DIR ("auto") default_cache_dir."""
    return default_cache_dir(data_dir) if choice in (None, "auto") else Path(choice)


def file_list_checksum(root: Path, samples) -> str:
    h = hashlib.sha256()
    for path, label in samples:
        p = Path(path)
        h.update(f"{p.relative_to(root)}\t{label}\t{p.stat().st_size}\n".encode())
    return h.hexdigest()


def cache_is_valid(directory: Path, split: str, checksum: str, count: int) -> bool:
    meta_file = directory / f"{split}_meta.json"
    try:  # a damaged meta file (not UTF-8, not JSON: both ValueErrors) means: rebuild
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        images = np.load(directory / f"{split}_u8.npy", mmap_mode="r")
        labels = np.load(directory / f"{split}_labels.npy", mmap_mode="r")
    except (OSError, ValueError):
        return False
    return (isinstance(meta, dict) and meta.get("version") == CACHE_VERSION
            and meta.get("checksum") == checksum and meta.get("sources") == count
            and images.shape == (meta.get("count"), 64, 64, 3)
            and labels.shape == (meta.get("count"),))


def _decode_rgb(path):
    from PIL import Image
    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB").resize((64, 64)) if img.size != (64, 64)
                              else img.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as exc:
        return f"{exc.__class__.__name__}: {str(exc)[:100]}"


def _default_sigterm() -> None:
    """Pool workers: the pool ends them with SIGTERM, which a training process's forked
    children otherwise ignore (common._child_signals)."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def build_split(directory: Path, split: str, samples, checksum: str, strict: bool,
                workers: int, log) -> None:
    """Decode ``samples`` into {split}_u8.npy / {split}_labels.npy / {split}_meta.json,
    written under temporary names and renamed into place (meta last), so a reader never sees
    half a cache. A progress line every 10 s."""
    from multiprocessing import get_context
    directory.mkdir(parents=True, exist_ok=True)
    tag = f".tmp-{platform.node()}-{os.getpid()}"
    t0 = last = time.perf_counter()
    images = np.empty((len(samples), 64, 64, 3), dtype=np.uint8)
    labels, bad = [], []
    with get_context("fork").Pool(max(1, workers), initializer=_default_sigterm) as pool:
        decoded = pool.imap(_decode_rgb, [p for p, _ in samples], chunksize=256)
        for i, ((path, label), img) in enumerate(zip(samples, decoded), 1):
            if isinstance(img, str):
                if strict:
                    raise UsageError(f"unreadable image {path} ({img}): replace or delete it, "
                                     f"or drop --strict to skip such files")
                bad.append(path)
            else:
                images[len(labels)] = img
                labels.append(label)
            if time.perf_counter() - last >= 10:
                last = time.perf_counter()
                log(f"data cache: {split} {i}/{len(samples)} images decoded "
                    f"({i / (last - t0):.0f} img/s)")
    images_tmp = directory / f"{split}_u8.npy{tag}"
    with open(images_tmp, "wb") as f:
        np.save(f, images[:len(labels)])
    labels_tmp = directory / f"{split}_labels.npy{tag}"
    with open(labels_tmp, "wb") as f:
        np.save(f, np.asarray(labels, dtype=np.int64))
    os.replace(images_tmp, directory / f"{split}_u8.npy")
    os.replace(labels_tmp, directory / f"{split}_labels.npy")
    meta_tmp = directory / f"{split}_meta.json{tag}"
    meta_tmp.write_text(json.dumps({"version": CACHE_VERSION, "checksum": checksum,
                                    "count": len(labels), "sources": len(samples),
                                    "skipped": bad[:20], "skipped_count": len(bad)}))
    os.replace(meta_tmp, directory / f"{split}_meta.json")
    log(f"data cache: decoded {len(labels)} {split} images into {directory} in "
        f"{time.perf_counter() - t0:.1f} s" + (f" ({len(bad)} unreadable left out, e.g. "
                                               f"{bad[0]})" if bad else ""))


def prepare(root, directory, strict: bool = False, workers: int = 1, log=print,
            scanned=None) -> Path:
    """Make sure ``directory`` holds a valid cache of the TinyImageNet tree at ``root``:
    build each split that is missing or stale, reuse the others. ``scanned``: the result of
    common.scan_tinyimagenet(root), when the caller has it already. Returns the directory."""
    root = Path(root)
    directory = cache_dir(root, directory)
    _, train, val = scanned or common.scan_tinyimagenet(root)
    try:
        for split, samples in zip(SPLITS, (train, val)):
            checksum = file_list_checksum(root, samples)
            if not cache_is_valid(directory, split, checksum, len(samples)):
                log(f"data cache: building {split} in {directory} (first use, or the dataset "
                    f"changed)")
                build_split(directory, split, samples, checksum, strict, workers, log)
    except OSError as exc:
        raise UsageError(f"cannot write the data cache in {directory} ({exc.strerror}): pass "
                         f"--data-cache DIR with a writable DIR") from None
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", help="the tiny-imagenet-200 folder (wnids.txt, train/, val/)")
    parser.add_argument("cache_dir", nargs="?", default="auto",
                        help="where the cache goes (default: beside the data dir, or ~/.cache "
                             "when that is read-only)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="decoding processes")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first unreadable image instead of leaving it out")
    args = parser.parse_args(argv)
    try:
        directory = prepare(args.data_dir, args.cache_dir, args.strict, args.workers,
                            log=lambda m: print(m, flush=True))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"data cache ready: {directory} (train with --data-cache {directory})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
