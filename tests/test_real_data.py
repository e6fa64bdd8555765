"""Fashion-MNIST, the one real dataset a machine without network can have (Debian's and
Ubuntu's dataset-fashion-mnist package, which .ci/run installs): read where it lies, trained
to the published accuracy, and the same accuracy from every strategy and world size."""

from __future__ import annotations

import argparse
import gzip
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from training import datasets
from training.faults import UsageError
from conftest import check_ok, metrics, run_script

FOLDER = datasets.FASHION_MNIST_DIR
NAMES = [n for pair in datasets.FASHION_MNIST_FILES.values() for n in pair]


def _package_present() -> bool:
    return all((FOLDER / f"{n}.gz").is_file() for n in NAMES)


@pytest.fixture(scope="module", autouse=True)
def fashion_mnist():
    """Skip only where the package cannot exist (no apt-get); where it can, its absence is a
    failure that says how to install it, so CI (which installs it) can never skip these."""
    if _package_present():
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"Fashion-MNIST is not in {FOLDER} and this machine has no apt-get to "
                    f"install dataset-fashion-mnist")
    pytest.fail(f"Fashion-MNIST is not in {FOLDER}: sudo apt-get install dataset-fashion-mnist "
                f"(bash .ci/run does)")


def _args(data_dir=None, model="mnist_net"):
    return argparse.Namespace(dataset="fashion-mnist", data_dir=data_dir and str(data_dir),
                              model=model)


def _one_line_error(proc, *fragments):
    """Exit 2, one error line on stderr that holds every fragment, and no traceback."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_the_package_reads_as_published():
    data = datasets.build_data(_args())
    assert (len(data.train), len(data.val), data.num_classes) == (60000, 10000, 10)
    assert data.input_shape == (1, 28, 28)
    for split, per_class in ((data.train, 6000), (data.val, 1000)):  # balanced classes
        assert torch.bincount(split.labels).tolist() == [per_class] * 10
    # the normalisation constants are this training split's own mean and std
    pixels = data.train.images.float() / 255
    mean, std = datasets.NORMALIZE["fashion-mnist"]
    assert pixels.mean().item() == pytest.approx(mean[0], abs=1e-4)
    assert pixels.std().item() == pytest.approx(std[0], abs=1e-4)
    image, label = data.train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and label.item() == 9


def test_torchvisions_layout_unzipped_reads_the_same(tmp_path):
    """--data-dir may hold torchvision's FashionMNIST/raw layout with the files unzipped; the
    images equal what torchvision's own IDX reader makes of them."""
    from torchvision.datasets.mnist import read_image_file, read_label_file
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for n in NAMES:
        with gzip.open(FOLDER / f"{n}.gz") as src:
            (raw / n).write_bytes(src.read())
    ours = datasets.build_data(_args(tmp_path))
    assert torch.equal(ours.val.images, read_image_file(str(raw / "t10k-images-idx3-ubyte")))
    assert torch.equal(ours.train.labels, read_label_file(str(raw / "train-labels-idx1-ubyte")))
    assert torch.equal(ours.train.images, datasets.build_data(_args()).train.images)


def test_a_three_channel_model_gets_the_grey_channel_repeated():
    data = datasets.build_data(_args(model="resnet18"))
    image, _ = data.train[3]
    assert data.input_shape == (3, 28, 28) and image.shape == (3, 28, 28)
    assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])
    assert "grey channel repeated" in data.description


@pytest.mark.parametrize("model, fragment", [("cnn", "--model mnist_net"),
                                             ("vit_b_16", "cannot take this dataset's 3x28x28")])
def test_a_model_that_cannot_take_28_pixels_is_refused(model, fragment):
    proc = run_script("ddp_train.py", ["--dataset", "fashion-mnist", "--model", model],
                      timeout=120)
    _one_line_error(proc, fragment)


def test_missing_files_say_how_to_get_them(tmp_path):
    (tmp_path / "README").write_text("not Fashion-MNIST")
    proc = run_script("fsdp_train.py", ["--dataset", "fashion-mnist", "--data-dir",
                                        str(tmp_path), "--epochs", "1"], timeout=120)
    _one_line_error(proc, "apt-get install dataset-fashion-mnist", str(tmp_path),
                    "FashionMNIST/raw")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README"]  # nothing written


def test_one_missing_file_is_named(tmp_path):
    """Before: "Fashion-MNIST's four files ... are not in DIR", though three were."""
    for n in NAMES[1:]:
        shutil.copy(FOLDER / f"{n}.gz", tmp_path)
    with pytest.raises(UsageError) as err:
        datasets.find_fashion_mnist(tmp_path)
    assert str(err.value).startswith(f"Fashion-MNIST in {tmp_path} lacks {NAMES[0]}(.gz): put "
                                     f"it there beside the others"), err.value
    assert not any(n in str(err.value) for n in NAMES[1:])


def test_a_damaged_file_is_named(tmp_path):
    for n in NAMES:
        shutil.copy(FOLDER / f"{n}.gz", tmp_path)
    damaged = tmp_path / "t10k-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:5000])  # a download cut short
    proc = run_script("dp_train.py", ["--dataset", "fashion-mnist", "--data-dir",
                                      str(tmp_path), "--epochs", "1"], timeout=120)
    _one_line_error(proc, f"{damaged} is damaged", "reinstall")


# --------------------------------------------------------------------------------------------
# Training on real data (CPU, gloo): one run of 2 epochs (2 processes) for the published
# accuracy, then one epoch of each other strategy and world size, compared with that run's
# first epoch: about 2 minutes on 2 cores, then 2 for FSDP and 2 for both one-process runs.
# --------------------------------------------------------------------------------------------

# --lr 0.03: 89.2% after 2 epochs on the 2-core CI machine; the default 0.01 gives 87.6%,
# too close to the 87% this test asks for.
TRAIN = ["--dataset", "fashion-mnist", "--lr", "0.03", "--num-workers", "0", "--amp", "off",
         "--log-every", "0"]


def _train(script, nproc=None, batch=64, epochs=2):
    started = time.monotonic()
    proc = run_script(script, [*TRAIN, "--epochs", str(epochs), "--batch-size", str(batch)],
                      nproc=nproc, timeout=600)
    check_ok(proc)
    lines = metrics(proc.stdout)
    assert all(m["dataset"] == "fashion-mnist" and int(m["global_batch"]) == 128 for m in lines)
    return lines, time.monotonic() - started


@pytest.fixture(scope="module")
def ddp_two_processes():
    return _train("ddp_train.py", nproc=2)


def test_ddp_two_processes_reach_the_published_accuracy(ddp_two_processes):
    """The published table: two convolutions and pooling reach 87.6-91.6% test accuracy."""
    lines, seconds = ddp_two_processes
    final = lines[-1]
    print(f"ddp, 2 processes, 2 epochs: {final['val_acc']}% in {seconds:.0f} s")
    assert final["epoch"] == "2" and float(final["val_acc"]) >= 87.0
    assert int(final["train_images"]) == 468 * 128  # a whole epoch: 60,000 in steps of 128


# (script, processes, batch per process): the global batch of 128 in every layout
COMPARED = [("ddp_train.py", 1, 128), ("fsdp_train.py", 2, 64), ("dp_train.py", None, 128)]


@pytest.fixture(scope="module")
def one_process_runs():
    """The one-process runs (DDP at 1, DataParallel) at once, each (one thread) on its own
    core of CI's two: both in the time of one. A test takes its run's result, or its failure,
    from its future."""
    with ThreadPoolExecutor(2) as pool:
        return {script: pool.submit(_train, script, nproc=nproc, batch=batch, epochs=1)
                for script, nproc, batch in COMPARED if (nproc or 1) == 1}


@pytest.mark.parametrize("script, nproc, batch", COMPARED)
def test_every_strategy_and_world_size_reaches_the_same_accuracy(ddp_two_processes, request,
                                                                 script, nproc, batch):
    """Seed 000: "metrics should match the behavior of single-node runs with the same global
    batch size". The same global batch of 128 and the same 468 steps, within 1 point of the
    reference's first epoch. One epoch is enough: the schedule does not depend on --epochs
    (no decay before --step-size epochs), so a 1-epoch run is the 2-epoch run's first epoch."""
    reference = next(m for m in ddp_two_processes[0] if m["epoch"] == "1")
    if (nproc or 1) == 1:
        lines, seconds = request.getfixturevalue("one_process_runs")[script].result()
    else:
        lines, seconds = _train(script, nproc=nproc, batch=batch, epochs=1)
    final = lines[-1]
    print(f"{script} nproc={nproc}, 1 epoch: {final['val_acc']}% in {seconds:.0f} s "
          f"(ddp at 2, epoch 1: {reference['val_acc']}%)")
    assert final["epoch"] == "1" and final["lr"] == reference["lr"]
    assert final["train_images"] == reference["train_images"]
    assert abs(float(final["val_acc"]) - float(reference["val_acc"])) <= 1.0
