"""TinyImageNet on disk: its original layout (``scan_tinyimagenet``), and a decode-once cache
of it in memory-mapped uint8 arrays, the input of --data-cache (``prepare``; the program
prepare_tinyimagenet.py builds it ahead, the training on each node's local rank 0 otherwise).

The cache holds, per split, {split}_u8.npy (N x 64 x 64 x 3), {split}_labels.npy and
{split}_meta.json; datasets.CachedSplit reads them. The meta file holds a checksum of the file
list (names, labels, sizes): when the dataset changes the cache is rebuilt, otherwise reused.
Unreadable images are left out and counted (and decoded on a later use, once they can be
read), an image of another size than 64x64 is resized with a warning naming it (--strict: stop
and name the first of either).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from training.faults import UsageError, disk_full, process_exists
from training.stopping import die_with_parent

# --------------------------------------------------------------------------------------------
# The layout: which file is which class
# --------------------------------------------------------------------------------------------

CACHE_VERSION = 1
SPLITS = ("train", "val")
IMG_EXTENSIONS = (".jpeg", ".jpg", ".png")


def read_text_file(path: Path) -> str:
    """A dataset text file (wnids.txt, val_annotations.txt) as str, or a UsageError naming it
    when it cannot be read or is not UTF-8 text (a damaged or wrong file)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not a text file (bytes that are not UTF-8 at offset "
                         f"{exc.start}): restore it from the dataset archive") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path} ({exc.strerror or exc}): make it readable or "
                         f"restore it from the dataset archive") from None


def _images_in(folder: Path) -> list:
    """The image files of ``folder``: regular files only (opening a pipe named .JPEG would
    wait for a writer for ever), told by the directory entry's type, without a stat each.
    Hidden files are none: a copy made on a Mac leaves ._val_0.JPEG beside val_0.JPEG (its
    AppleDouble metadata), which read as images without a label, or unreadable ones.
    A symbolic link to nothing (a tree of links into a scratch space that was purged) is
    refused, not skipped: a smaller dataset would train without a word."""
    with os.scandir(folder) as entries:
        named = [e for e in entries if os.path.splitext(e.name)[1].lower() in IMG_EXTENSIONS
                 and not e.name.startswith(".")]
    dangling = sorted(e.name for e in named if e.is_symlink() and not os.path.exists(e.path))
    if dangling:
        raise UsageError(f"{len(dangling)} image(s) in {folder} are symbolic links to files that "
                         f"do not exist (first: {dangling[0]} -> "
                         f"{os.readlink(folder / dangling[0])}): restore the files they point "
                         f"to, or delete those links to train without them")
    return sorted(Path(e.path) for e in named if e.is_file())


_HINT = ("give the tiny-imagenet-200 folder, which holds wnids.txt, train/ and val/ "
         "(--data-dir, or prepare_tinyimagenet.py's first argument)")


def scan_tinyimagenet(root) -> tuple:
    """Read TinyImageNet's ORIGINAL layout: classes from wnids.txt (sorted), train images from
    train/<wnid>/images/, val labels from val/val_annotations.txt (val/images/ is one flat
    folder; reading it with ImageFolder would give every image the same label). A val folder
    already split into val/<wnid>/[images/] is accepted too.

    Returns (classes, train_samples, val_samples) with samples as (path, class index).
    """
    root = Path(root)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise UsageError(f"data dir {root} {what}: {_HINT}")
    try:
        classes = _scan_classes(root / "wnids.txt")
        index = {wnid: i for i, wnid in enumerate(classes)}
        train = _scan_train(root / "train", classes, index)
        val = _scan_val(root / "val", classes, index)
    except OSError as exc:  # a folder of the tree this user may not list or enter
        raise UsageError(f"cannot read {exc.filename or root} ({exc.strerror or exc}): make "
                         f"the dataset readable (chmod -R a+rX {root})") from None
    return classes, train, val


def _idx_folder(root: Path) -> tuple:
    """(folder, --dataset) when ``root`` holds MNIST-format IDX files (train-images-idx3-ubyte
    and the like, gzipped or not) where --dataset fashion-mnist or mnist reads them, instead of
    TinyImageNet; (None, None) otherwise."""
    for folder, dataset in ((root, "fashion-mnist"), (root / "FashionMNIST" / "raw",
                                                      "fashion-mnist"),
                            (root / "MNIST" / "raw", "mnist")):
        patterns = ("*-idx[13]-ubyte", "*-idx[13]-ubyte.gz")
        if folder.is_dir() and any(p.is_file() for pattern in patterns
                                   for p in folder.glob(pattern)):
            return folder, dataset
    return None, None


def _scan_classes(wnids_file: Path) -> list:
    """The class ids of wnids.txt, sorted."""
    if not wnids_file.is_file():
        folder, dataset = _idx_folder(wnids_file.parent)
        if folder:  # the data dir defaults to TinyImageNet: a Fashion-MNIST folder lands here
            either = (f"--dataset {dataset}" if folder != wnids_file.parent else
                      "--dataset fashion-mnist (or, for MNIST's digits, --dataset mnist with the "
                      "files in DIR/MNIST/raw)")  # the two datasets' files have the same names
            raise UsageError(f"{folder} holds MNIST-format IDX files, not TinyImageNet (no "
                             f"wnids.txt): train on them with {either}, which reads them as "
                             f"they are (no cache to build)")
        if wnids_file.exists():  # a folder (an archive unpacked onto itself) is no list
            raise UsageError(f"{wnids_file} is a folder, not TinyImageNet's list of class ids: "
                             f"restore the file from the dataset archive")
        raise UsageError(f"{wnids_file} is missing: {_HINT}")
    classes = sorted({w.strip() for w in read_text_file(wnids_file).split() if w.strip()})
    if not classes:
        raise UsageError(f"{wnids_file} lists no class ids: restore it from the dataset archive")
    return classes


def _scan_train(train_dir: Path, classes: list, index: dict) -> list:
    """The training samples: train/<wnid>/images/ (or train/<wnid>/) of every class, and no
    folder of a class that wnids.txt does not list."""
    if not train_dir.is_dir():
        raise UsageError(f"{train_dir} is missing: {_HINT}")
    for d in sorted(p for p in train_dir.iterdir() if p.is_dir()):
        if d.name not in index:
            raise UsageError(f"train/{d.name} is not listed in wnids.txt: remove the folder "
                             f"or restore wnids.txt from the dataset archive")
    train = []
    for wnid in classes:
        folder = train_dir / wnid / "images"
        if not folder.is_dir():
            folder = train_dir / wnid
        if not folder.is_dir():
            raise UsageError(f"no training folder for class {wnid} (expected "
                             f"{train_dir / wnid / 'images'}): {_HINT}")
        images = _images_in(folder)
        if not images:
            raise UsageError(f"{folder} holds no images: restore it from the dataset archive")
        train += [(str(p), index[wnid]) for p in images]
    return train


def _scan_val(val_dir: Path, classes: list, index: dict) -> list:
    """The validation samples, labelled by val_annotations.txt, else by a val/ folder already
    split into one folder per class."""
    annotations = val_dir / "val_annotations.txt"
    if annotations.is_file():
        val = _scan_annotated_val(annotations, val_dir / "images", index)
    elif val_dir.is_dir() and any((val_dir / w).is_dir() for w in classes):
        val = []
        for wnid in classes:
            folder = val_dir / wnid / "images" if (val_dir / wnid / "images").is_dir() \
                else val_dir / wnid
            if folder.is_dir():
                val += [(str(p), index[wnid]) for p in _images_in(folder)]
    else:
        raise UsageError(f"{annotations} is missing and val/ is not split into class folders: "
                         f"the labels of val/images/ live only in val_annotations.txt; restore "
                         f"it from the dataset archive")
    if not val:
        raise UsageError(f"{val_dir} holds no validation images: restore it from the archive")
    return val


def _scan_annotated_val(annotations: Path, images_dir: Path, index: dict) -> list:
    """The samples of val/images/ with the labels of val_annotations.txt; every line must name
    an existing image of a known class, and every image must have a line."""
    present = _images_in(images_dir) if images_dir.is_dir() else []
    val, first_line = [], {}
    for lineno, line in enumerate(read_text_file(annotations).splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) < 2:
            raise UsageError(f"{annotations}:{lineno} is malformed (expected "
                             f"'<file> <wnid> ...'): restore it from the dataset archive")
        name, wnid = parts[0], parts[1]
        # an image counted twice, or one from outside val/images/ (a training image), would
        # make a wrong validation split without a word
        if Path(name).name != name:
            raise UsageError(f"{annotations}:{lineno} names {name}, a path, where val/images/ "
                             f"holds its images by file name: restore it from the dataset "
                             f"archive")
        if name in first_line:
            raise UsageError(f"{annotations}:{lineno} names {name} again (line "
                             f"{first_line[name]} named it first), and an image has one "
                             f"label: restore it from the dataset archive")
        first_line[name] = lineno
        if wnid not in index:
            raise UsageError(f"{annotations}:{lineno} names class {wnid}, which is not in "
                             f"wnids.txt: the data dir mixes two datasets; restore both "
                             f"files from the same archive")
        path = images_dir / name
        if not path.is_file():
            raise UsageError(f"{annotations}:{lineno} names {path}, which does not exist: "
                             f"restore val/images/ from the dataset archive")
        val.append((str(path), index[wnid]))
    annotated = {Path(p).name for p, _ in val}
    stray = [p.name for p in present if p.name not in annotated]
    if stray:
        raise UsageError(f"{len(stray)} image(s) in {images_dir} have no line in "
                         f"{annotations} (first: {stray[0]}): restore both from the same "
                         f"dataset archive")
    return val


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------

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
        # os.fsencode: a file name's own bytes, which need not be UTF-8 (str.encode refused
        # them); the same bytes as before for every name that is
        h.update(os.fsencode(p.relative_to(root)) + f"\t{label}\t{p.stat().st_size}\n".encode())
    return h.hexdigest()


def cache_is_valid(directory: Path, split: str, checksum: str, count: int,
                   root: Path) -> bool:
    """The cache of ``split`` holds the images of this file list, as it was built: the
    checksum matches and no image it left out as unreadable can be read now (a file made
    readable again, whose name, label and size are the same, is decoded, not lost for good).
    The images left out are listed relative to the data dir, which may be reached by another
    path next time; each reuse tries to read them again, a moment for a few."""
    meta_file = directory / f"{split}_meta.json"
    # A damaged meta file (not UTF-8, or not JSON: both raise ValueError) means a rebuild.
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        images = np.load(directory / f"{split}_u8.npy", mmap_mode="r")
        labels = np.load(directory / f"{split}_labels.npy", mmap_mode="r")
    except (OSError, ValueError):
        return False
    return (isinstance(meta, dict) and meta.get("version") == CACHE_VERSION
            and meta.get("checksum") == checksum and meta.get("sources") == count
            and images.shape == (meta.get("count"), 64, 64, 3)
            and labels.shape == (meta.get("count"),)
            and isinstance(meta.get("skipped", []), list)
            and len(meta.get("skipped", [])) == meta.get("skipped_count", 0)  # older: 20 at most
            and all(isinstance(_decode_rgb(root / path), str) for path in meta.get("skipped", [])))


SIZE = 64  # every TinyImageNet image is 64x64 pixels


def load_rgb(path):
    """An image as RGB at TinyImageNet's 64x64, and its own (width, height) when it had
    another size and was resized (None when it had the right one). The folder path
    (datasets.ImageList) and the cache share it, so both treat an odd image the same way.
    Raises PIL's errors for a file that cannot be read."""
    from PIL import Image  # imported here: runs on synthetic data or the cache never need it
    try:
        with Image.open(path) as img:  # some TinyImageNet images are greyscale
            rgb = img.convert("RGB")
    except Image.DecompressionBombError as exc:  # not an OSError: said as PIL's others are
        raise ValueError(str(exc)) from None
    if rgb.size == (SIZE, SIZE):
        return rgb, None
    return rgb.resize((SIZE, SIZE)), rgb.size


def wrong_size(path, size, strict: bool) -> str:
    """The sentence about an image that is not 64x64: --strict's error, else the warning."""
    text = f"{path} is {size[0]}x{size[1]} pixels, not TinyImageNet's {SIZE}x{SIZE}"
    if strict:
        return f"{text}: resize or delete it, or drop --strict to have it resized to {SIZE}x{SIZE}"
    return f"warning: {text}: resized to {SIZE}x{SIZE} (--strict stops at such files)"


def _decode_rgb(path):
    """(pixels, original size or None), or the reason the file cannot be read."""
    try:
        rgb, resized_from = load_rgb(path)
        return np.asarray(rgb, dtype=np.uint8), resized_from
    except (OSError, ValueError, SyntaxError) as exc:
        return f"{exc.__class__.__name__}: {str(exc)[:100]}"


def _start_cache_worker() -> None:
    """A cache worker ends with its rank. SIGTERM ends it too: when a worker dies, the pool
    ends the others with SIGTERM, which a rank's forked children otherwise ignore
    (stopping._child_signals), and it would wait for them for ever."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Ctrl-C reaches the whole foreground process group: the parent stops the build (its
    # workers end after their chunk). A worker killed by it too broke the pool under the
    # parent's feet, and its shutdown then waited for ever now and then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the parent held Ctrl-C back while it forked the workers (build_split): one that came in
    # the meantime is dropped here, now that it is set aside
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent()


def _remove_stale_parts(directory: Path, split: str) -> None:
    """The temporary files of an earlier build of ``split`` on this host whose process is gone
    (a Ctrl-C or a kill while it wrote them): a train split's is 1.2 GB, and a new build has
    another process id, so it never reused them."""
    for part in directory.glob(f"{split}_*.tmp-{platform.node()}-*"):
        pid = part.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_exists(int(pid)):
            part.unlink(missing_ok=True)


CHUNK = 256  # images a cache worker decodes per task


def build_split(directory: Path, split: str, samples, checksum: str, strict: bool,
                workers: int, log, root: Path) -> None:
    """Decode ``samples`` into {split}_u8.npy / {split}_labels.npy / {split}_meta.json,
    written under temporary names and renamed into place (meta last), so a reader never sees
    half a cache. A progress line every 10 s."""
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_parts(directory, split)
    tag = f".tmp-{platform.node()}-{os.getpid()}"
    t0 = last = time.perf_counter()
    images = np.empty((len(samples), 64, 64, 3), dtype=np.uint8)
    labels, bad = [], []
    # On a bad image under --strict the queued chunks are cancelled and the workers end after
    # the one they decode, unsignalled (a SIGTERM to a worker forked a moment before is
    # dropped, stopping._child_signals, and a multiprocessing pool's terminate() then waited
    # for that worker for ever).
    # no more workers than chunks of CHUNK images: --workers 200 forked 200 for 52 images
    workers = max(1, min(workers, -(-len(samples) // CHUNK)))
    with ProcessPoolExecutor(workers, mp_context=get_context("fork"),
                             initializer=_start_cache_worker) as pool:
        try:
            # Ctrl-C held back while the workers are forked (the first map forks them all):
            # a worker it reached before its initializer set it aside died, and the build
            # read as "a worker died (out of memory?)". It is raised here, once they are.
            held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                decoded = pool.map(_decode_rgb, [p for p, _ in samples], chunksize=CHUNK)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            for i, ((path, label), img) in enumerate(zip(samples, decoded), 1):
                if isinstance(img, str):
                    if strict:
                        raise UsageError(f"unreadable image {path} ({img}): replace or delete "
                                         f"it, or drop --strict to skip such files")
                    bad.append((path, img))
                else:
                    pixels, resized_from = img
                    if resized_from and strict:
                        raise UsageError(wrong_size(path, resized_from, strict=True))
                    if resized_from:
                        log(wrong_size(path, resized_from, strict=False))
                    images[len(labels)] = pixels
                    labels.append(label)
                if time.perf_counter() - last >= 10:
                    last = time.perf_counter()
                    log(f"data cache: {split} {i}/{len(samples)} images decoded "
                        f"({i / (last - t0):.0f} img/s)")
        except BrokenProcessPool:
            raise UsageError(f"a data-cache worker died while decoding the {split} images "
                             f"(killed: out of memory?): build the cache with fewer workers "
                             f"(prepare_tinyimagenet.py --workers N, or --num-workers N)"
                             ) from None
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    if samples and not labels:  # an empty split trained nothing, or evaluated to 0 of 0
        raise UsageError(f"none of the {len(samples)} {split} images of {root} could be "
                         f"decoded (e.g. {bad[0][0]}: {bad[0][1]}): the data dir is damaged; "
                         f"restore it from the dataset archive")
    parts = [directory / f"{split}_{name}{tag}" for name in ("u8.npy", "labels.npy",
                                                             "meta.json")]
    try:
        with open(parts[0], "wb") as f:
            np.save(f, images[:len(labels)])
        with open(parts[1], "wb") as f:
            np.save(f, np.asarray(labels, dtype=np.int64))
        os.replace(parts[0], directory / f"{split}_u8.npy")
        os.replace(parts[1], directory / f"{split}_labels.npy")
        parts[2].write_text(json.dumps({"version": CACHE_VERSION, "checksum": checksum,
                                        "count": len(labels), "sources": len(samples),
                                        "skipped": [str(Path(path).relative_to(root))
                                                    for path, _ in bad],
                                        "skipped_count": len(bad)}))
        os.replace(parts[2], directory / f"{split}_meta.json")
    except BaseException:  # a full disk, a Ctrl-C: no part of this build is left behind
        for part in parts:
            part.unlink(missing_ok=True)
        raise
    log(f"data cache: decoded {len(labels)} {split} images into {directory} in "
        f"{time.perf_counter() - t0:.1f} s" + (f" ({len(bad)} unreadable left out, e.g. "
                                               f"{bad[0][0]}: {bad[0][1]}; decoded on the "
                                               f"next use once readable)" if bad else ""))


def prepare(root, directory, strict: bool = False, workers: int = 1, log=print,
            scanned=None) -> Path:
    """Make sure ``directory`` holds a valid cache of the TinyImageNet tree at ``root``:
    build each split that is missing or stale, reuse the others. ``scanned``: the result of
    scan_tinyimagenet(root), when the caller has it already. Returns the directory."""
    root = Path(root)
    directory = cache_dir(root, directory)
    _, train, val = scanned or scan_tinyimagenet(root)
    try:
        for split, samples in zip(SPLITS, (train, val)):
            checksum = file_list_checksum(root, samples)
            if not cache_is_valid(directory, split, checksum, len(samples), root):
                log(f"data cache: building {split} in {directory} (first use, or the dataset "
                    f"changed)")
                build_split(directory, split, samples, checksum, strict, workers, log, root)
    except OSError as exc:
        where = "(--data-cache DIR, or prepare_tinyimagenet.py's CACHE_DIR)"
        if disk_full(exc):  # numpy's own check of the space read "(None)" below
            need = (len(train) + len(val)) * 3 * SIZE * SIZE / 2**20  # uint8 pixels
            made = next(p for p in (directory, *directory.resolve().parents) if p.is_dir())
            raise UsageError(f"no space left for the data cache in {directory} "
                             f"({shutil.disk_usage(made).free / 2**20:.0f} MiB free, this "
                             f"tree's cache needs about {need:.0f} MiB): free space there or "
                             f"give another folder {where}") from None
        raise UsageError(f"cannot write the data cache in {directory} "
                         f"({exc.strerror or exc}): give a writable folder {where}") from None
    return directory
