"""How many images per second each input path hands to the device-copy step, on this machine.

    python bench/input_pipeline.py --data-dir /data/tiny-imagenet-200
    python tests/make_tinyimagenet.py /tmp/tin --classes 20 --train-per-class 200   # test data
    python bench/input_pipeline.py --data-dir /tmp/tin

folder: the workshop script's way. JPEG files decoded with PIL, RandomCrop + flip + ToTensor +
        Normalize per image in DataLoader workers; measured at every worker count from 0 to the
        CPU count, the best one reported.
cache:  --data-cache. uint8 batches gathered from the memory-mapped decoded array; their crop,
        flip and normalisation then run on the device, per batch, after the copy (measured
        separately below, on this machine's device).

Prints `folder: N img/s` and `cache: N img/s`, then the details.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from training import datasets, faults, loading, measure  # noqa: E402


def rate(loader, seconds: float, warmup: int = 2) -> float:
    """Images per second drawn from ``loader`` over about ``seconds`` (after warm-up)."""
    it = iter(loader)
    for _ in range(warmup):
        try:
            next(it)
        except StopIteration:  # fewer batches than the warm-up: start the epoch again
            it = iter(loader)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            images, _ = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        n += images.shape[0]
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="TinyImageNet folder (original layout)")
    p.add_argument("--batch-size", type=int, default=256, help="images per batch")
    p.add_argument("--seconds", type=float, default=8.0, help="measuring time per setting")
    p.add_argument("--cache-dir", default="auto", help="where the uint8 cache lives or goes")
    p.add_argument("--max-workers", type=int, default=None,
                   help="largest DataLoader worker count tried for the folder path (CPU count)")
    a = p.parse_args(argv)
    if a.batch_size < 1:
        p.error(f"--batch-size must be at least 1, not {a.batch_size}")
    if not 0 < a.seconds < float("inf"):  # 0 s measures nothing (and divides by 0)
        p.error(f"--seconds must be a time above 0, not {a.seconds:g}")
    cpus = len(os.sched_getaffinity(0))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = argparse.Namespace(data_dir=a.data_dir, dataset="tinyimagenet", model="resnet50",
                              image_size=None,
                              strict=False, num_workers=cpus, data_cache=None, seed=0,
                              data_on_device=False)
    try:
        folder = datasets.build_data(args)
        if len(folder.train) < a.batch_size:  # drop_last: the loaders would make no batch
            raise faults.UsageError(
                f"{a.data_dir} has {len(folder.train)} training images, fewer than one batch "
                f"of {a.batch_size}: pass --batch-size {len(folder.train)} or less")
        args.data_cache = a.cache_dir
        cached = datasets.build_data(args)  # builds the cache on first use
    except faults.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    def sampler(ds):
        return DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)

    folder_rates = {}
    for workers in range(0, (a.max_workers if a.max_workers is not None else cpus) + 1):
        args.num_workers = workers
        loader = loading.make_loader(folder.train, sampler(folder.train), a.batch_size, args,
                                     device, drop_last=True)
        folder_rates[workers] = rate(loader, a.seconds)
    best_w = max(folder_rates, key=folder_rates.get)
    cache_rates = {}
    for workers in (0, 1):
        args.num_workers = workers
        loader = loading.make_loader(cached.train, sampler(cached.train), a.batch_size, args,
                                     device, drop_last=True)
        cache_rates[workers] = rate(loader, a.seconds)
    best_c = max(cache_rates, key=cache_rates.get)

    # the cache path's augmentation, on this machine's device, per batch
    u8, _ = cached.train[list(range(min(a.batch_size, len(cached.train))))]
    u8 = u8.to(device)
    for _ in range(3):
        cached.device_augment(u8, train=True)
    measure.synchronize(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds / 2:
        cached.device_augment(u8, train=True)
        n += u8.shape[0]
    measure.synchronize(device)
    aug_rate = n / (time.perf_counter() - t0)

    print(f"folder: {folder_rates[best_w]:.0f} img/s")
    print(f"cache: {cache_rates[best_c]:.0f} img/s")
    print(f"ratio cache/folder: {cache_rates[best_c] / folder_rates[best_w]:.1f}x")
    print(f"details: batch {a.batch_size}, {len(folder.train)} training images, {cpus} CPUs "
          f"({platform.processor() or platform.machine()}), torch {torch.__version__}")
    print("  folder workers: " + ", ".join(f"{w}: {r:.0f}" for w, r in folder_rates.items())
          + f" img/s (best {best_w})")
    print("  cache workers: " + ", ".join(f"{w}: {r:.0f}" for w, r in cache_rates.items())
          + f" img/s (best {best_c})")
    print(f"  cache-path augmentation on {device.type}: {aug_rate:.0f} img/s "
          f"(crop + flip + normalize per batch, after the copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
