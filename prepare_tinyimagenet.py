"""Decode TinyImageNet once into the uint8 cache that --data-cache reads.

Decoding 100,000 JPEGs with PIL every epoch keeps a GPU waiting; decoded once, a batch is one
read from a memory map. Run it once per node (the Slurm launchers do, before torchrun), or let
the first training run with --data-cache build it on each node's local rank 0:

    python prepare_tinyimagenet.py /data/tiny-imagenet-200                # beside the data
    python prepare_tinyimagenet.py /data/tiny-imagenet-200 /scratch/tin-cache
    torchrun --nproc-per-node 4 ddp_train.py --data-dir /data/tiny-imagenet-200 --data-cache

The cache's format, and when it is rebuilt, are in training/tinyimagenet.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from training import ctrl_c  # first: a Ctrl-C while torch loads ends the script quietly

ctrl_c.quiet_while_loading(__name__)

from training.faults import UsageError
from training.tinyimagenet import prepare


def main(argv=None) -> int:
    ctrl_c.raises()  # KeyboardInterrupt, caught below
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
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if not args.cache_dir.strip():  # "" was the current folder
        parser.error("the cache folder is empty (\"\"): give a folder, or leave it out for "
                     "the default beside the data")
    try:
        directory = prepare(args.data_dir, args.cache_dir, args.strict, args.workers,
                            log=lambda m: print(m, flush=True))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the splits already written stay, and are reused
        print("error: interrupted (Ctrl-C); the cache is not complete: run the same command "
              "again, it reuses what was finished", file=sys.stderr)
        return 130
    print(f"data cache ready: {directory} (train with --data-cache {directory})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
