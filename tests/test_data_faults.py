"""Damaged data: unreadable validation images must leave the validation count and sums exact
at every world size (the DistributedSampler pads ranks with duplicates, and a skipped image
must not let one of them be counted), and a dataset file that is not text must stop the run
with one line naming it (exit code 2), not a traceback."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from training import common, datasets, faults, loading, models, tinyimagenet
from conftest import check_ok, metrics, run_script

CPU = torch.device("cpu")


def _damaged_copy(src, dst, unreadable=(), drop=()):
    """Copy the TinyImageNet tree; make the val images at these annotation indices unreadable
    (zero bytes, or a truncated JPEG), and remove those at the ``drop`` indices entirely."""
    shutil.copytree(src, dst)
    ann = dst / "val" / "val_annotations.txt"
    lines = ann.read_text().splitlines(keepends=True)
    for k, i in enumerate(unreadable):
        image = dst / "val" / "images" / lines[i].split()[0]
        image.write_bytes(b"" if k % 2 == 0 else image.read_bytes()[:200])
    for i in drop:
        (dst / "val" / "images" / lines[i].split()[0]).unlink()
    ann.write_text("".join(l for i, l in enumerate(lines) if i not in drop))
    return dst


def _args(data_dir, cache=None, on_device=False):
    return argparse.Namespace(data_dir=str(data_dir), dataset="tinyimagenet", model="resnet18",
                              image_size=None,
                              data_on_device=on_device, strict=False, num_workers=0, seed=0,
                              data_cache=cache)


def _truth(model, val, prepare=None):
    """[loss_sum, correct, count] over the readable images of ``val``, in one batch."""
    items = [item for item in (val[i] for i in range(len(val))) if item is not None]
    x = torch.stack([img for img, _ in items])
    y = torch.tensor([label for _, label in items])
    with torch.no_grad():
        logits = model(x).float()
    return torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                         (logits.argmax(1) == y).sum().item(), len(items)],
                        dtype=torch.float64)


def _all_ranks(model, dataset, world, batch, args, prepare=None):
    """evaluate() on every rank of a ``world``-rank job, in this process, summed as the
    all-reduce in the scripts sums them."""
    total = torch.zeros(3, dtype=torch.float64)
    for rank in range(world):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        loader = loading.make_loader(dataset, sampler, batch, args, CPU, val=True)
        total += common.evaluate(model, loader, CPU, None, loading.real_samples(sampler), prepare)
    return total


@pytest.fixture(scope="module")
def damaged(tiny_imagenet, tmp_path_factory):
    """The 40-image tree with 5 unreadable val images, one in the real part of a padded rank
    at every world size that pads below, one (1) also copied as padding, and a linear model."""
    root, _ = tiny_imagenet
    bad = _damaged_copy(root, tmp_path_factory.mktemp("damaged") / "tin",
                        unreadable=(1, 5, 13, 22, 35))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 4)).eval()
    return bad, model


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_unreadable_val_images_leave_count_and_sums_exact(damaged, world):
    data_dir, model = damaged
    val = datasets.build_data(_args(data_dir)).val
    for n in (37, 40):  # 37 is padded at every world size above 1, 40 at 3
        subset = datasets.ImageList(val.samples[:n])
        want = _truth(model, subset)
        assert want[2] == n - 5
        for batch in (5, 8):  # no batch made of unreadable images only
            got = _all_ranks(model, subset, world, batch, _args(data_dir))
            assert got[2] == want[2], (n, batch)
            assert got[1] == want[1], (n, batch)
            assert got[0].item() == pytest.approx(want[0].item(), rel=1e-6), (n, batch)


@pytest.mark.parametrize("on_device", [False, True])
def test_cache_path_still_counts_each_val_image_once(damaged, tmp_path, on_device):
    """The cache leaves unreadable images out when it is built: its batches (and
    --data-on-device's) carry no survivors mask, and evaluate() counts them as before."""
    data_dir, model = damaged
    want = _truth(model, datasets.build_data(_args(data_dir)).val)
    args = _args(data_dir, cache=str(tmp_path / "c"), on_device=on_device)
    data = datasets.build_data(args)
    assert len(data.val) == 35
    prepare = loading.batch_finisher(data, models.memory_format(model, CPU))
    got = _all_ranks(model, data.val, 3, 8, args, prepare)
    assert got[2] == want[2] == 35 and got[1] == want[1]
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-4)


@pytest.mark.parametrize("script,nproc,unreadable,drop", [
    ("ddp_train.py", 3, (4,), ()),      # 40 images: ranks 1 and 2 get one duplicate each
    ("fsdp_train.py", 2, (1,), (38,)),  # 39 images: rank 1 gets one duplicate
    ("dp_train.py", None, (4,), ()),    # one process: no padding, the same count
])
def test_script_reports_exact_val_metrics_with_an_unreadable_image(tiny_imagenet, tmp_path,
                                                                   script, nproc, unreadable,
                                                                   drop):
    """The run's [METRIC] line against the saved weights evaluated here on the readable
    images. squeezenet1_1 has no BatchNorm, so every rank evaluates the same weights."""
    root, _ = tiny_imagenet
    data_dir = _damaged_copy(root, tmp_path / "tin", unreadable, drop)
    weights = tmp_path / "w.pt"
    proc = run_script(script, ["--data-dir", str(data_dir), "--model", "squeezenet1_1",
                               "--epochs", "1", "--batch-size", "8", "--num-workers", "0",
                               "--amp", "off", "--save-model", str(weights)], nproc=nproc)
    check_ok(proc)
    m = metrics(proc.stdout)[-1]
    model = models.build_model("squeezenet1_1", 4, (3, 64, 64))
    model.load_state_dict(torch.load(weights, weights_only=True))
    loss_sum, correct, count = _truth(model.eval(),
                                      datasets.build_data(_args(data_dir)).val).tolist()
    assert count == 40 - len(drop) - len(unreadable)
    assert int(m["val_images"]) == count
    assert float(m["val_loss"]) == pytest.approx(loss_sum / count, rel=1e-4)
    assert float(m["val_acc"]) == pytest.approx(100.0 * correct / count, abs=1e-3)
    assert f"skipped 0 unreadable training and {len(unreadable)} validation image(s)" \
        in proc.stdout


@pytest.mark.parametrize("script", ["fsdp_train.py", "dp_train.py"])  # ddp: in test_ddp.py
def test_binary_wnids_is_one_line_exit_2_for_every_script(tiny_imagenet, tmp_path, script):
    root, _ = tiny_imagenet
    data_dir = tmp_path / "tin"
    shutil.copytree(root, data_dir)
    (data_dir / "wnids.txt").write_bytes(b"n01443537\n\x89PNG\r\n\x1a\n\x00\xff")
    proc = run_script(script, ["--data-dir", str(data_dir), "--epochs", "1"], timeout=180)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert errors == [f"error: {data_dir / 'wnids.txt'} is not a text file (bytes that are "
                      f"not UTF-8 at offset 10): restore it from the dataset archive"]


def test_a_wnids_txt_that_is_a_folder_is_called_so_not_missing(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    data = tmp_path / "tin"
    shutil.copytree(root, data)
    (data / "wnids.txt").unlink()
    (data / "wnids.txt").mkdir()
    with pytest.raises(faults.UsageError) as refused:
        tinyimagenet.scan_tinyimagenet(data)
    assert str(refused.value) == (f"{data / 'wnids.txt'} is a folder, not TinyImageNet's list "
                                  f"of class ids: restore the file from the dataset archive")


def test_unreadable_dataset_file_is_a_usage_error(tmp_path):
    with pytest.raises(faults.UsageError, match=f"cannot read {tmp_path} "):
        tinyimagenet.read_text_file(tmp_path)  # a folder where a file should be


MNIST_OFFLINE = ("Error downloading train-images-idx3-ubyte.gz:\nTried "
                 "https://ossci-datasets.s3.amazonaws.com/mnist/, got:\n<urlopen error [Errno -2] "
                 "Name or service not known>\nTried http://yann.lecun.com/exdb/mnist/, got:\n"
                 "<urlopen error [Errno -2] Name or service not known>\n")


def test_mnist_without_network_is_one_clean_line(tmp_path, monkeypatch):
    """torchvision's MNIST error (its exact text without network) spans lines, one per mirror
    tried: the sentence was three lines with the inner error cut at 120 characters."""
    import torchvision.datasets

    def offline(*_, **__):
        raise RuntimeError(MNIST_OFFLINE)
    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    args = argparse.Namespace(dataset="mnist", data_dir=str(tmp_path))
    with pytest.raises(faults.UsageError) as refused:
        datasets._torchvision_data(args)
    assert str(refused.value) == (
        f"could not load mnist from {tmp_path} (RuntimeError: Error downloading "
        f"train-images-idx3-ubyte.gz: <urlopen error [Errno -2] Name or service not known>); "
        f"without network, put MNIST/raw/*-ubyte.gz (from the official site) in {tmp_path} and "
        f"pass --data-dir {tmp_path}")


@pytest.mark.parametrize("junk", [False, True], ids=["nothing there", "a damaged file"])
def test_mnist_offline_on_a_fresh_clone_asks_for_the_files(tmp_path, monkeypatch, junk):
    """torchvision makes MNIST/raw before it downloads: offline, on a fresh clone, that empty
    folder was 'there but incomplete or damaged ... delete it to download it again', which
    loops without network. Empty, it is nothing there; a file in it is a damaged copy."""
    import urllib.error

    import torchvision.datasets.mnist

    def offline(*_, **__):  # what each mirror gives without network, on any machine
        raise urllib.error.URLError("[Errno -2] Name or service not known")
    monkeypatch.setattr(torchvision.datasets.mnist, "download_and_extract_archive", offline)
    if junk:
        (tmp_path / "MNIST" / "raw").mkdir(parents=True)
        (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").write_bytes(b"junk\n")
    args = argparse.Namespace(dataset="mnist", data_dir=str(tmp_path))
    with pytest.raises(faults.UsageError) as refused:
        datasets._torchvision_data(args)
    said = str(refused.value)
    assert (tmp_path / "MNIST" / "raw").is_dir()  # torchvision made it
    if junk:
        assert f"{tmp_path / 'MNIST' / 'raw'} is there but incomplete or damaged" in said, said
    else:
        assert said.endswith(f"without network, put MNIST/raw/*-ubyte.gz (from the official "
                             f"site) in {tmp_path} and pass --data-dir {tmp_path}"), said


@pytest.mark.parametrize("damaged", ["cifar-10-python.tar.gz", "cifar-10-batches-py"])
def test_a_damaged_cifar10_archive_is_named_not_asked_for(tmp_path, monkeypatch, damaged):
    """A cut or damaged cifar-10-python.tar.gz (or extracted folder) in --data-dir: torchvision
    fails its checksum and tries to download it again, and without network the sentence
    said to put the archive where it already was."""
    import urllib.error

    import torchvision.datasets.cifar

    def offline(*_, **__):  # what the download gives without network, on any machine
        raise urllib.error.URLError("[Errno -2] Name or service not known")
    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", offline)
    if damaged.endswith(".gz"):
        (tmp_path / damaged).write_bytes(b"junk\n")
    else:
        (tmp_path / damaged).mkdir()
        (tmp_path / damaged / "data_batch_1").write_bytes(b"junk\n")
    args = argparse.Namespace(dataset="cifar10", data_dir=str(tmp_path))
    with pytest.raises(faults.UsageError) as refused:
        datasets._torchvision_data(args)
    said = str(refused.value)
    assert said.startswith(f"could not load cifar10 from {tmp_path}: {tmp_path / damaged} is "
                           f"there but incomplete or damaged (its checksum is not the "
                           f"published one, and downloading it again failed: "), said
    assert said.endswith("); replace it with a fresh copy of cifar-10-python.tar.gz from the "
                         "official site, or delete it to download it again"), said


@pytest.mark.parametrize("meta", [b"\xff\xfe\x00", b"[]", b'{"version": 1}',
                                  b'{"version": 1, "checksum": "c", "sources": 1}'])
def test_damaged_cache_meta_means_rebuild_not_a_crash(tmp_path, meta):
    np.save(tmp_path / "val_u8.npy", np.zeros((1, 64, 64, 3), dtype=np.uint8))
    np.save(tmp_path / "val_labels.npy", np.zeros(1, dtype=np.int64))
    (tmp_path / "val_meta.json").write_bytes(meta)
    assert tinyimagenet.cache_is_valid(tmp_path, "val", "c", 1, tmp_path) is False
    # and the intact meta is still accepted
    (tmp_path / "val_meta.json").write_text(json.dumps(
        {"version": tinyimagenet.CACHE_VERSION, "checksum": "c", "sources": 1, "count": 1}))
    assert tinyimagenet.cache_is_valid(tmp_path, "val", "c", 1, tmp_path) is True


def test_the_cache_build_ends_its_workers_without_a_signal(tiny_imagenet, tmp_path,
                                                           monkeypatch):
    """A SIGTERM sent to a cache worker forked a moment earlier, before the worker let go of its
    rank's signal pipe, reached the rank as its own: the rank stopped during start-up (a
    resume test failed so on a loaded machine). The pool's workers now end on their own."""
    _, train, _ = tinyimagenet.scan_tinyimagenet(tiny_imagenet[0])
    sent, kill = [], os.kill
    monkeypatch.setattr(os, "kill", lambda pid, signum: (sent.append(signum), kill(pid, signum)))
    tinyimagenet.build_split(tmp_path / "cache", "train", train, "x", False, 2, lambda line: None,
                             tiny_imagenet[0])
    assert signal.SIGTERM not in sent and (tmp_path / "cache" / "train_meta.json").is_file()


def test_a_ctrl_c_that_reaches_a_cache_worker_before_it_set_ctrl_c_aside_is_dropped(
        tiny_imagenet, tmp_path, monkeypatch):
    """A Ctrl-C in the first milliseconds of a build reached a worker forked a moment before
    its initializer set SIGINT aside: the worker died, and the build said "a worker died
    (out of memory?)". The parent now holds SIGINT back while it forks them (it gets its own
    once they are, and stops the build)."""
    _, train, _ = tinyimagenet.scan_tinyimagenet(tiny_imagenet[0])
    set_aside = tinyimagenet._start_cache_worker

    def reached_first():
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C, before the handler
        set_aside()

    monkeypatch.setattr(tinyimagenet, "_start_cache_worker", reached_first)
    tinyimagenet.build_split(tmp_path / "cache", "train", train, "x", False, 2, lambda line: None,
                             tiny_imagenet[0])
    assert (tmp_path / "cache" / "train_meta.json").is_file()


def test_a_strict_cache_build_stops_at_a_bad_image_without_signalling_its_workers(
        tiny_imagenet, tmp_path, monkeypatch):
    """--strict and an unreadable image: the queued chunks are cancelled and the workers end
    on their own. A multiprocessing pool ended them with SIGTERM, which a worker forked a
    moment before drops, and its terminate() then waited for that worker for ever."""
    _, train, _ = tinyimagenet.scan_tinyimagenet(tiny_imagenet[0])
    bad = tmp_path / "bad.JPEG"
    bad.write_bytes(b"not an image")
    sent, kill = [], os.kill
    monkeypatch.setattr(os, "kill", lambda pid, signum: (sent.append(signum), kill(pid, signum)))
    with pytest.raises(faults.UsageError, match=f"unreadable image {bad}"):
        tinyimagenet.build_split(tmp_path / "cache", "train", [(bad, 0)] + train * 4, "x",
                                 True, 2, lambda line: None, tiny_imagenet[0])
    assert signal.SIGTERM not in sent
    assert not multiprocessing.active_children()  # the workers have ended
    assert not (tmp_path / "cache" / "train_meta.json").exists()


RANK_BUILDS_CACHE = """
import os, signal, sys, time
from pathlib import Path
from training import faults, stopping, tinyimagenet
stopping.catch_stop_signals()  # as in a rank: its forked children ignore SIGTERM
root, cache, fault = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
_, train, _ = tinyimagenet.scan_tinyimagenet(root)
decode, doomed = tinyimagenet._decode_rgb, train[300 % len(train)][0]
def faulty_decode(path):  # the forked workers run this one
    if fault == "slow":
        time.sleep(0.05)
    elif path == doomed:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    return decode(path)
tinyimagenet._decode_rgb = faulty_decode
try:
    tinyimagenet.build_split(cache, "train", train * 20, "x", False, 2, print, root)
except faults.UsageError as exc:
    print(f"error: {exc}")
"""


def test_a_cache_worker_that_dies_stops_the_build_with_the_reason(tiny_imagenet, tmp_path):
    """A worker killed mid-build (out of memory): the pool ends the other workers, which a
    rank's forked children would ignore, and the build stops with one sentence. It hung."""
    from conftest import REPO, env_for_tests
    run = subprocess.run([sys.executable, "-c", RANK_BUILDS_CACHE, str(tiny_imagenet[0]),
                          str(tmp_path / "cache"), "die"], cwd=REPO, env=env_for_tests(),
                         capture_output=True, text=True, timeout=120)
    assert ("error: a data-cache worker died while decoding the train images (killed: out of "
            "memory?): build the cache with fewer workers") in run.stdout, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_a_killed_rank_leaves_no_cache_worker_behind(tiny_imagenet, tmp_path):
    """A rank killed (SIGKILL: the OOM killer, a node failure's cleanup) in the middle of
    building the cache: its workers end with it instead of living on as orphans."""
    import psutil
    from conftest import REPO, env_for_tests, wait_for
    proc = subprocess.Popen([sys.executable, "-c", RANK_BUILDS_CACHE, str(tiny_imagenet[0]),
                             str(tmp_path / "cache"), "slow"], cwd=REPO, env=env_for_tests(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: len(psutil.Process(proc.pid).children()) == 2, 60)
        workers = psutil.Process(proc.pid).children()
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    for worker in alive:
        worker.kill()
    assert not alive, f"cache workers left running: {[w.pid for w in alive]}"


def test_prepare_tinyimagenet_builds_the_cache_the_training_reuses(tiny_imagenet, tmp_path):
    """The decode-once step on its own (the launchers run it once per node before torchrun):
    a training run with --data-cache then reuses it instead of decoding again."""
    from conftest import REPO, env_for_tests
    root, _ = tiny_imagenet
    cache = tmp_path / "cache"
    made = subprocess.run([sys.executable, str(REPO / "prepare_tinyimagenet.py"), str(root),
                           str(cache), "--workers", "2"], capture_output=True, text=True,
                          env=env_for_tests(), timeout=300)
    assert made.returncode == 0, made.stderr
    assert "data cache: decoded 160 train images" in made.stdout
    assert f"data cache ready: {cache}" in made.stdout
    run = run_script("ddp_train.py", ["--data-dir", str(root), "--data-cache", str(cache),
                                      "--model", "resnet18", "--epochs", "1", "--batch-size",
                                      "16", "--num-workers", "0"])
    check_ok(run)
    assert "data cache: building" not in run.stdout
    assert metrics(run.stdout)[-1]["train_images"] == "160"
    bad = subprocess.run([sys.executable, str(REPO / "prepare_tinyimagenet.py"),
                          str(tmp_path / "nope")], capture_output=True, text=True,
                         env=env_for_tests(), timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: data dir ")
    assert "Traceback" not in bad.stderr
    (tmp_path / "afile").write_text("")
    # its sentences name its own arguments, not only the training's flags
    for args, says in (([tmp_path / "afile"], "afile is a file, not a folder"),
                       ([tmp_path / "nope"], "prepare_tinyimagenet.py's first argument"),
                       ([root, tmp_path / "afile"], "prepare_tinyimagenet.py's CACHE_DIR"),
                       ([root, "--workers", "0"], "--workers must be at least 1")):
        bad = subprocess.run([sys.executable, str(REPO / "prepare_tinyimagenet.py"),
                              *map(str, args)], capture_output=True, text=True,
                             env=env_for_tests(), timeout=120)
        assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr


def test_a_macs_appledouble_files_are_not_images(tiny_imagenet, tmp_path):
    """A tree copied on a Mac holds ._<name> beside each file (its metadata, not a JPEG): in
    val/images/ they stopped the run ("have no line in val_annotations.txt ... restore both
    from the same dataset archive"), in train/ they would be unreadable images. They are not
    images: the tree reads as the clean one does."""
    root, _ = tiny_imagenet
    mac = tmp_path / "tin"
    shutil.copytree(root, mac)
    for image in [*mac.glob("val/images/*.JPEG"), *mac.glob("train/*/images/*.JPEG")][::7]:
        (image.parent / f"._{image.name}").write_bytes(b"\x00\x05\x16\x07" + b"\0" * 78)
    assert list(mac.rglob("._*.JPEG"))
    relative = [[(str(Path(p).relative_to(top)), label) for p, label in split]
                for top, split in ((root, tinyimagenet.scan_tinyimagenet(root)[1]),
                                   (mac, tinyimagenet.scan_tinyimagenet(mac)[1]),
                                   (root, tinyimagenet.scan_tinyimagenet(root)[2]),
                                   (mac, tinyimagenet.scan_tinyimagenet(mac)[2]))]
    assert relative[0] == relative[1] and relative[2] == relative[3]


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_image_that_is_a_link_to_nothing_is_named_not_skipped(tiny_imagenet, tmp_path,
                                                                  split):
    """A tree of links into a scratch space that was purged: a link whose file is gone was
    skipped without a word (train: a smaller dataset, no count; val/: its line was 'a file
    that does not exist'). It is one sentence naming the link and where it points, for the
    training scripts and prepare_tinyimagenet.py alike."""
    from conftest import REPO
    root, _ = tiny_imagenet
    data = tmp_path / "tin"
    shutil.copytree(root, data)
    images = sorted((data / "train").glob("*/images/*.JPEG") if split == "train"
                    else (data / "val" / "images").glob("*.JPEG"))
    gone = tmp_path / "scratch" / images[3].name  # a link into a purged scratch space
    images[3].unlink()
    images[3].symlink_to(gone)
    words = (f"error: 1 image(s) in {images[3].parent} are symbolic links to files that do not "
             f"exist (first: {images[3].name} -> {gone}): restore the files they point to, or "
             f"delete those links to train without them")
    with pytest.raises(faults.UsageError, match="are symbolic links to files that do not exist"):
        tinyimagenet.scan_tinyimagenet(data)
    proc = subprocess.run([sys.executable, str(REPO / "prepare_tinyimagenet.py"), str(data),
                           str(tmp_path / "cache")], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip() == words, proc.stderr
    # a link to a file that exists is an image, as before
    gone.parent.mkdir()
    shutil.copy(images[4], gone)
    assert len(tinyimagenet.scan_tinyimagenet(data)[1 if split == "train" else 2]) == \
        len(tinyimagenet.scan_tinyimagenet(root)[1 if split == "train" else 2])


@pytest.mark.parametrize("failing, error", [
    ("save", OSError("Not enough free space to write 3145728 bytes after offset 128")),  # numpy
    ("save", OSError(28, "No space left on device")),
    ("mkdir", OSError(28, "No space left on device"))])  # the cache folder itself not made
def test_a_full_disk_under_the_data_cache_is_said_so(tiny_imagenet, tmp_path, monkeypatch,
                                                     failing, error):
    """No space for the cache: numpy's own check (an OSError with no errno or strerror) read
    "cannot write the data cache in DIR (None): give a writable folder"; it and ENOSPC now say
    there is no space, how much is free and how much the cache needs. Nothing of the build is
    left behind."""
    root, _ = tiny_imagenet
    cache = tmp_path / "cache"

    def full(*args, **kwargs):
        raise error

    if failing == "save":
        monkeypatch.setattr(tinyimagenet.np, "save", full)
    else:
        monkeypatch.setattr(tinyimagenet.Path, "mkdir", full)
    with pytest.raises(faults.UsageError) as raised:
        tinyimagenet.prepare(root, cache, log=lambda line: None)
    message = str(raised.value)
    assert message.startswith(f"no space left for the data cache in {cache} (") and \
        " MiB free, this tree's cache needs about 2 MiB): free space there or give another " \
        "folder (--data-cache DIR, or prepare_tinyimagenet.py's CACHE_DIR)" in message, message
    assert not cache.exists() or list(cache.iterdir()) == []


def test_an_image_left_out_as_unreadable_is_decoded_once_it_can_be_read(tiny_imagenet,
                                                                         tmp_path):
    """The cache left out an image it could not read, which was then repaired with the same
    name, label and size (here its bytes garbled, then restored; on a cluster, made readable
    again with chmod). The file list's checksum did not change, so the cache was reused
    without the image for good; now the next use decodes it, also when it reaches the data
    by another path, and a still unreadable image does not make the cache be rebuilt. A
    cache of the earlier format, which listed 20 of the images it left out, is rebuilt."""
    root, _ = tiny_imagenet
    data, cache = tmp_path / "tin", tmp_path / "cache"
    shutil.copytree(root, data)
    image = sorted((data / "train").glob("*/images/*.JPEG"))[0]
    good = image.read_bytes()
    image.write_bytes(b"\0" * len(good))

    def prepare(data):
        logs = []
        tinyimagenet.prepare(data, cache, log=logs.append)
        return "\n".join(logs), json.loads((cache / "train_meta.json").read_text())["count"]

    logs, count = prepare(data)
    assert f"(1 unreadable left out, e.g. {image}: UnidentifiedImageError" in logs, logs
    assert count == 159
    logs, count = prepare(data)
    assert "building" not in logs and count == 159  # still unreadable: the cache is reused
    moved = data.rename(tmp_path / "moved")  # the same data, reached by another path
    (moved / image.relative_to(data)).write_bytes(good)
    logs, count = prepare(moved)
    assert "data cache: building train" in logs and count == 160, logs
    assert "building val" not in logs  # the other split is reused
    meta = json.loads((cache / "val_meta.json").read_text())
    checksum = tinyimagenet.file_list_checksum(moved, tinyimagenet.scan_tinyimagenet(moved)[2])
    assert tinyimagenet.cache_is_valid(cache, "val", checksum, meta["sources"], moved)
    (cache / "val_meta.json").write_text(json.dumps(meta | {"skipped_count": 25}))
    assert not tinyimagenet.cache_is_valid(cache, "val", checksum, meta["sources"], moved)


_SCAN_AS_NOBODY = """
import os, sys
sys.path.insert(0, sys.argv[1])
from training import faults, tinyimagenet
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)  # as 'nobody', as a user would be
try:
    tinyimagenet.scan_tinyimagenet(sys.argv[2])
except faults.UsageError as err:
    sys.exit(f"error: {err}")
"""


def test_an_unreadable_class_folder_and_a_pipe_among_the_images_are_no_traceback_nor_hang(
        tiny_imagenet):
    """A class folder another user may not read: a PermissionError traceback before, now one
    sentence. A pipe named like an image: the cache build waited on it for ever, now it is not
    an image."""
    import stat
    import tempfile
    from conftest import REPO
    root, info = tiny_imagenet
    top = Path(tempfile.mkdtemp(prefix="unreadable-"))  # not under pytest's root-only tmp dir
    data, wnid = top / "tin", sorted(info["wnids"])[0]
    folder = data / "train" / wnid / "images"
    try:
        shutil.copytree(root, data)
        os.mkfifo(folder / "pipe.JPEG")
        _, train, _ = tinyimagenet.scan_tinyimagenet(data)
        assert len(train) == 160 and not any("pipe" in path for path, _ in train)
        for p in [top, *top.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
        folder.chmod(0)
        proc = subprocess.run([sys.executable, "-c", _SCAN_AS_NOBODY, str(REPO), str(data)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == (f"error: cannot read {folder} (Permission denied): make "
                                       f"the dataset readable (chmod -R a+rX {data})")
    finally:
        if folder.exists():
            folder.chmod(0o755)
        shutil.rmtree(top, ignore_errors=True)


def _odd_sized_copy(src, dst):
    """The TinyImageNet tree with its first validation image replaced by a 100x80 one."""
    from PIL import Image
    shutil.copytree(src, dst)
    name = (dst / "val" / "val_annotations.txt").read_text().split()[0]
    odd = dst / "val" / "images" / name
    Image.new("RGB", (100, 80), (200, 30, 30)).save(odd, format="JPEG")
    return odd


@pytest.mark.parametrize("cache", [False, True])
def test_an_image_of_the_wrong_size_is_resized_and_named_on_both_paths(tiny_imagenet,
                                                                      tmp_path, cache):
    """Without the cache such an image broke the batch ('stack expects each tensor to be equal
    size') and the run hung with live loader workers; the cache resized it silently."""
    root, _ = tiny_imagenet
    odd = _odd_sized_copy(root, tmp_path / "tin")
    args = ["--data-dir", str(tmp_path / "tin"), "--model", "squeezenet1_1", "--epochs", "1",
            "--batch-size", "8", "--num-workers", "2", "--max-steps-per-epoch", "2",
            "--amp", "off"]
    if cache:
        args += ["--data-cache", str(tmp_path / "cache")]
    proc = run_script("ddp_train.py", args, timeout=300)
    check_ok(proc)
    warning = f"warning: {odd} is 100x80 pixels, not TinyImageNet's 64x64: resized to 64x64"
    assert warning in proc.stdout + proc.stderr
    assert int(metrics(proc.stdout)[-1]["val_images"]) == 40  # counted, not dropped
    if cache:  # a fresh cache: the one above was built, and is reused, as it is
        args[-1] = str(tmp_path / "strict-cache")
    strict = run_script("ddp_train.py", [*args, "--strict"], timeout=300)
    assert strict.returncode == 2 and "Traceback" not in strict.stderr, strict.stderr
    assert f"{odd} is 100x80 pixels, not TinyImageNet's 64x64: resize or delete it" \
        in strict.stderr


def test_a_file_name_that_is_not_utf8_and_a_huge_image_are_said_not_raised(tmp_path,
                                                                            monkeypatch):
    """prepare_tinyimagenet.py ended on a traceback for both: a file name whose bytes are not
    UTF-8 (the cache's checksum encoded it as text), and PIL's DecompressionBombError (not one
    of the errors that mark an image unreadable)."""
    from PIL import Image
    named = tmp_path / os.fsdecode(b"bad\xff.JPEG")
    Image.new("RGB", (64, 64), (10, 20, 30)).save(named, format="JPEG")
    plain = tmp_path / "plain.JPEG"
    shutil.copy(named, plain)
    checksum = tinyimagenet.file_list_checksum(tmp_path, [(str(named), 0), (str(plain), 1)])
    assert checksum != tinyimagenet.file_list_checksum(tmp_path, [(str(plain), 0)])
    assert tinyimagenet._decode_rgb(named)[0].shape == (64, 64, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 is now a "bomb" to PIL
    reason = tinyimagenet._decode_rgb(plain)
    assert isinstance(reason, str) and reason.startswith("ValueError: Image size (4096 pixels) "
                                                         "exceeds limit"), reason


PREPARE_SLOWLY = """
import sys, time
import prepare_tinyimagenet
from training import tinyimagenet
decode = tinyimagenet._decode_rgb
def slow_decode(path):  # the forked workers run this one
    time.sleep(0.02)
    return decode(path)
tinyimagenet._decode_rgb = slow_decode
sys.exit(prepare_tinyimagenet.main(sys.argv[1:]))
"""


def test_ctrl_c_during_the_cache_build_is_one_line_and_leaves_no_part_behind(tiny_imagenet,
                                                                             tmp_path):
    """Ctrl-C (SIGINT to the terminal's whole process group) while prepare_tinyimagenet.py
    decoded: a KeyboardInterrupt traceback, the workers killed under the pool (whose shutdown
    then hung now and then), and the temporary parts, 1.2 GB for the train split, left behind.
    A part an earlier build left (its process gone) is removed by the next build."""
    from conftest import REPO, env_for_tests, read_until
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / f"train_u8.npy.tmp-{platform.node()}-999999999"  # no such process
    stale.write_bytes(b"half a cache")
    proc = subprocess.Popen([sys.executable, "-c", PREPARE_SLOWLY, str(tiny_imagenet[0]),
                             str(cache), "--workers", "2"], cwd=REPO, env=env_for_tests(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    read_until(proc, "data cache: building train")
    time.sleep(1)  # the workers decode (160 images at 20 ms, 3 s or more)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert err == ("error: interrupted (Ctrl-C); the cache is not complete: run the same "
                   "command again, it reuses what was finished\n")
    assert not list(cache.glob("*.tmp-*")) and not (cache / "train_meta.json").exists()


def test_an_empty_cache_folder_is_refused(tmp_path, monkeypatch, capsys):
    """prepare_tinyimagenet.py DATA "" wrote the cache into the current folder."""
    import prepare_tinyimagenet
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        prepare_tinyimagenet.main([str(tmp_path), ""])
    assert ended.value.code == 2 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.endswith("error: the cache folder is empty (\"\"): give a "
                                            "folder, or leave it out for the default beside "
                                            "the data\n")


def test_no_more_cache_workers_than_chunks_of_images(tiny_imagenet, tmp_path, monkeypatch):
    """--workers 200 forked 200 processes to decode 52 images (12 s)."""
    _, train, _ = tinyimagenet.scan_tinyimagenet(tiny_imagenet[0])
    started, pool = [], tinyimagenet.ProcessPoolExecutor
    monkeypatch.setattr(tinyimagenet, "ProcessPoolExecutor",
                        lambda workers, **kw: started.append(workers) or pool(workers, **kw))
    for samples in (train[:52], train * 2):  # 1 chunk, then 320 images: 2
        tinyimagenet.build_split(tmp_path / "cache", "train", samples, "x", False, 200,
                                 lambda line: None, tiny_imagenet[0])
    assert started == [1, 2]


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_split_whose_every_image_is_unreadable_is_refused_by_the_cache(tiny_imagenet, tmp_path,
                                                                       split):
    """Every val image unreadable: the cache held none, and the run reported val_loss 0 and
    val_acc 0% (of 0 images) as results, exit 0. Every train image: "lower --batch-size",
    which no batch size fixes. The folder path already says the data dir is damaged."""
    root = tmp_path / "data"
    shutil.copytree(tiny_imagenet[0], root)
    folder = root / "val" / "images" if split == "val" else root / "train"
    for image in folder.rglob("*.JPEG"):
        image.write_bytes(b"")
    with pytest.raises(faults.UsageError, match=rf"none of the \d+ {split} images of {root} could be "
                                         rf"decoded \(e\.g\. .*\): the data dir is damaged; "
                                         rf"restore it from the dataset archive"):
        tinyimagenet.prepare(root, tmp_path / "cache", log=lambda line: None)
    assert not list((tmp_path / "cache").rglob(f"{split}_*"))  # no empty cache to reuse
