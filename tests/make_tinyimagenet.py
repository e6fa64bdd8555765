"""Generate a small dataset in TinyImageNet's exact original layout, with learnable classes.

    tiny-imagenet-200/
        wnids.txt                      one class id (wnid) per line, in no particular order
        words.txt                      wnid<TAB>name
        train/<wnid>/images/<wnid>_<k>.JPEG
        train/<wnid>/<wnid>_boxes.txt
        val/images/val_<k>.JPEG        ONE flat folder: labels only in val_annotations.txt
        val/val_annotations.txt        val_<k>.JPEG<TAB><wnid><TAB>x0<TAB>y0<TAB>x1<TAB>y1
        test/images/test_<k>.JPEG      unlabelled

Each class has its own colour and stripe direction plus per-image noise, so a small network
learns it in a few epochs. Val images are shuffled across classes, as in the real set, so a
loader that reads val/ with ImageFolder gets them wrong.

    python tests/make_tinyimagenet.py /tmp/tiny --classes 10 --train-per-class 50 --val-per-class 10
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def class_image(class_idx: int, n_classes: int, rng: np.random.Generator, size: int = 64):
    hue = class_idx / max(1, n_classes)
    base = np.array([np.sin(2 * np.pi * (hue + k / 3)) * 0.5 + 0.5 for k in range(3)]) * 200 + 25
    yy, xx = np.mgrid[0:size, 0:size]
    direction = (xx if class_idx % 2 else yy) + (class_idx // 2) * 3
    stripes = ((direction // 4) % 2)[..., None] * 40.0
    img = base[None, None, :] + stripes + rng.normal(0, 12, (size, size, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def make_tree(root, classes: int = 4, train_per_class: int = 40, val_per_class: int = 10,
              test_images: int = 4, seed: int = 0, grey_every: int = 17) -> dict:
    """Write the tree; return {"wnids": [...], "val_labels": {filename: wnid}}."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    pyrng = random.Random(seed)
    wnids = [f"n{rng.integers(10**7, 10**8 - 1):08d}" for _ in range(classes)]
    (root / "train").mkdir(parents=True, exist_ok=True)
    shuffled = list(wnids)
    pyrng.shuffle(shuffled)  # wnids.txt is not sorted in the real archive either
    (root / "wnids.txt").write_text("".join(w + "\n" for w in shuffled))
    (root / "words.txt").write_text("".join(f"{w}\tclass {i}\n" for i, w in enumerate(wnids)))
    sorted_index = {w: i for i, w in enumerate(sorted(wnids))}
    counter = 0
    for w in wnids:
        folder = root / "train" / w / "images"
        folder.mkdir(parents=True, exist_ok=True)
        boxes = []
        for k in range(train_per_class):
            img = class_image(sorted_index[w], classes, rng)
            counter += 1
            if grey_every and counter % grey_every == 0:
                img = img.convert("L")  # the real set has a few greyscale images
            name = f"{w}_{k}.JPEG"
            img.save(folder / name, quality=90)
            boxes.append(f"{name}\t0\t0\t63\t63\n")
        (root / "train" / w / f"{w}_boxes.txt").write_text("".join(boxes))
    labels = [w for w in wnids for _ in range(val_per_class)]
    pyrng.shuffle(labels)
    (root / "val" / "images").mkdir(parents=True, exist_ok=True)
    lines, val_labels = [], {}
    for k, w in enumerate(labels):
        name = f"val_{k}.JPEG"
        class_image(sorted_index[w], classes, rng).save(root / "val" / "images" / name, quality=90)
        lines.append(f"{name}\t{w}\t0\t0\t63\t63\n")
        val_labels[name] = w
    (root / "val" / "val_annotations.txt").write_text("".join(lines))
    (root / "test" / "images").mkdir(parents=True, exist_ok=True)
    for k in range(test_images):
        class_image(k % classes, classes, rng).save(root / "test" / "images" / f"test_{k}.JPEG")
    return {"wnids": wnids, "val_labels": val_labels}


def _write_class(job) -> None:
    root, w, class_idx, classes, count, seed = job
    rng = np.random.default_rng([seed, class_idx])
    folder = Path(root) / "train" / w / "images"
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(count):
        class_image(class_idx, classes, rng).save(folder / f"{w}_{k}.JPEG", quality=90)
    (Path(root) / "train" / w / f"{w}_boxes.txt").write_text(
        "".join(f"{w}_{k}.JPEG\t0\t0\t63\t63\n" for k in range(count)))


def make_tree_parallel(root, classes: int = 200, train_per_class: int = 500,
                       val_per_class: int = 50, workers: int = 0, seed: int = 0) -> dict:
    """The same layout at full TinyImageNet size, the training classes written by ``workers``
    processes (0: one per CPU). Images differ from make_tree's (one random stream per class)."""
    import os
    from multiprocessing import get_context
    info = make_tree(root, classes, 0, val_per_class, seed=seed)  # wnids, val/, test/
    order = sorted(info["wnids"])
    jobs = [(str(root), w, order.index(w), classes, train_per_class, seed) for w in info["wnids"]]
    with get_context("fork").Pool(workers or len(os.sched_getaffinity(0))) as pool:
        pool.map(_write_class, jobs)
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to create (the tiny-imagenet-200 equivalent)")
    p.add_argument("--classes", type=int, default=10, help="number of classes")
    p.add_argument("--train-per-class", type=int, default=50, help="training images per class")
    p.add_argument("--val-per-class", type=int, default=10, help="validation images per class")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--workers", type=int, default=1,
                   help="processes writing the training classes (0: one per CPU); above 1 "
                        "the images come from one random stream per class")
    a = p.parse_args(argv)
    for flag, value, least in (("--classes", a.classes, 1), ("--workers", a.workers, 0),
                               ("--train-per-class", a.train_per_class, 0),
                               ("--val-per-class", a.val_per_class, 0)):
        if value < least:
            p.error(f"{flag} must be at least {least}, not {value}")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        print(f"error: {a.out} is a file, not a folder: give a new folder (or an existing "
              f"one) to write the tree into", file=sys.stderr)
        return 2
    try:
        if a.workers == 1:
            make_tree(a.out, a.classes, a.train_per_class, a.val_per_class, seed=a.seed)
        else:
            make_tree_parallel(a.out, a.classes, a.train_per_class, a.val_per_class,
                               a.workers, a.seed)
    except OSError as exc:  # a parent that is a file, no permission, a full disk
        print(f"error: cannot write the tree into {a.out} ({exc.strerror or exc}): give a "
              f"folder you can write to", file=sys.stderr)
        return 2
    print(f"wrote {a.classes} classes to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
