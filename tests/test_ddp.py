"""ddp_train.py end to end on CPU (gloo): output contract, exact equivalence of 1 and 2
processes, exact validation counting, TinyImageNet's original layout, and clean errors."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler


from training import contract, datasets, distributed, faults, loading, models, tinyimagenet
from conftest import (FAST, REPO, check_ok, env_for_tests, epoch_lines, fake_gpus, metrics,
                      run_script, runs_two_at_a_time)


def test_torchrun_two_processes_prints_contract_lines():
    proc = run_script("ddp_train.py", FAST, nproc=2)
    check_ok(proc)
    out = proc.stdout
    assert "note: this run uses built-in synthetic data (--data-dir DIR for TinyImageNet)" in out
    assert "global batch: 32 = 16 per process x 2 processes" in out
    lines = epoch_lines(out)
    assert [(e, n) for e, n, *_ in lines] == [("1", "2"), ("2", "2")]
    ms = metrics(out)
    assert len(ms) == 3 and "final" not in ms[0] and ms[-1]["final"] == "1"
    assert float(ms[-1]["total_time_s"]) > 0
    # the final line repeats the last epoch's, plus final=1 and the run's total time
    assert {k: v for k, v in ms[-1].items() if k not in contract.FINAL_KEYS} == ms[-2]
    for m in ms:
        assert set(contract.METRIC_KEYS) <= set(m)
        assert (m["strategy"], m["world_size"], m["nodes"], m["gpus_per_node"]) == \
            ("ddp", "2", "1", "2")
        assert (m["per_gpu_batch"], m["global_batch"], m["device"]) == ("16", "32", "cpu")
        assert m["train_images"] == "256" and m["val_images"] == "64"
        assert len(m["peak_mem_per_gpu_mib"].split("/")) == 2
        assert float(m["throughput_img_s"]) > 0
    # epoch line and [METRIC] line carry the same numbers
    e = lines[-1]
    m = ms[1]
    assert float(e[3]) == pytest.approx(float(m["train_loss"]), abs=1e-3)
    assert float(e[6]) == pytest.approx(float(m["val_acc"]), abs=1e-2)


def _weights(path):
    return torch.load(path, weights_only=True)


def test_two_processes_equal_one_process_with_double_batch(tmp_path):
    """2 processes x batch B must end with the same weights as 1 process x batch 2B: this is
    only true if DDP averages gradients and the shards are disjoint halves of each batch."""
    common_args = ["--model", "cnn", "--synthetic-size", "320", "--epochs", "2",
                   "--num-workers", "0", "--amp", "off", "--seed", "3", "--lr", "0.02"]
    one = run_script("ddp_train.py", common_args + ["--batch-size", "32",
                                                     "--save-model", str(tmp_path / "one.pt")])
    two = run_script("ddp_train.py", common_args + ["--batch-size", "16",
                                                     "--save-model", str(tmp_path / "two.pt")],
                     nproc=2)
    check_ok(one)
    check_ok(two)
    w1, w2 = _weights(tmp_path / "one.pt"), _weights(tmp_path / "two.pt")
    assert w1.keys() == w2.keys() and not any(k.startswith("module.") for k in w1)
    fresh = models.build_model("cnn", 10, (3, 32, 32)).state_dict()
    assert w1.keys() == fresh.keys()
    moved = diff = 0.0
    for k in w1:
        # Float sums in another order differ in the last bits, and 20 SGD steps through ReLU
        # kinks grow that: torch 2.15 on CPU ends at 2e-4 on one bias of the classifier (whose
        # weights moved 0.03). A wrong average or overlapping shards move weights by ~0.1.
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-3, atol=5e-4)
        diff = max(diff, (w1[k] - w2[k]).abs().max().item())
        moved = max(moved, (w1[k] - fresh[k]).abs().max().item())
    # training moved the weights far more than the two runs differ (0.37 against 4e-4 with
    # the uint8 synthetic data; a wrong average, ~0.1 apart, fails this as it fails the above)
    assert moved > 100 * diff
    # validation of the same weights: 80 samples split over 2 ranks, counted exactly once
    m1, m2 = metrics(one.stdout)[-1], metrics(two.stdout)[-1]
    assert m1["val_images"] == m2["val_images"] == "80"
    assert float(m1["val_loss"]) == pytest.approx(float(m2["val_loss"]), rel=1e-4)
    assert m1["val_acc"] == m2["val_acc"]
    assert m1["train_images"] == m2["train_images"] == "320"


def test_validation_counts_each_sample_once_when_world_does_not_divide(tmp_path):
    """65 val samples over 2 ranks: DistributedSampler pads rank 1 with a duplicate."""
    args = FAST + ["--synthetic-size", "260", "--save-model", str(tmp_path / "m.pt")]
    proc = run_script("ddp_train.py", args, nproc=2)
    check_ok(proc)
    m = metrics(proc.stdout)[-1]
    assert m["val_images"] == "65"
    # recompute the validation metrics of the saved weights in one process, no sampler
    model = models.build_model("cnn", 10, (3, 32, 32))
    model.load_state_dict(_weights(tmp_path / "m.pt"))
    model.eval()
    val = datasets.SyntheticImages(65, (3, 32, 32), 10, 0, "val")
    finish = datasets.DeviceAugment(*datasets.NORMALIZE["synthetic"], crop_flip=False)
    x = finish(torch.stack([val[i][0] for i in range(65)]), train=False)
    y = torch.tensor([val[i][1] for i in range(65)])
    with torch.no_grad():
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y).item()
    acc = 100.0 * (logits.argmax(1) == y).float().mean().item()
    assert float(m["val_loss"]) == pytest.approx(loss, rel=1e-4)
    assert float(m["val_acc"]) == pytest.approx(acc, abs=1e-3)


@pytest.mark.parametrize("n,world", [(100, 2), (101, 2), (101, 3), (7, 4), (64, 4)])
def test_train_shards_disjoint_and_cover(n, world):
    """The train sampler exactly as ddp_train.py builds it: disjoint shards covering the set
    less at most world-1 samples (drop_last), a new permutation each epoch."""
    dataset = list(range(n))
    perms = []
    for epoch in (0, 1):
        shards = []
        for rank in range(world):
            s = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                   seed=0, drop_last=True)
            s.set_epoch(epoch)
            shards.append(list(s))
        flat = [i for shard in shards for i in shard]
        assert len(flat) == len(set(flat)), "a sample was given to two ranks"
        assert len({len(s) for s in shards}) == 1
        assert n - len(flat) < world
        perms.append(flat)
    assert perms[0] != perms[1]


@pytest.mark.parametrize("n,world", [(65, 2), (10, 3), (3, 4), (64, 4), (1, 2)])
def test_real_samples_matches_padding(n, world):
    dataset = list(range(n))
    counted = []
    for rank in range(world):
        s = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        k = loading.real_samples(s)
        counted += list(s)[:k]
    assert sorted(counted) == dataset


def test_tinyimagenet_labels_follow_annotations(tiny_imagenet):
    root, info = tiny_imagenet
    classes, train, val = tinyimagenet.scan_tinyimagenet(root)
    assert classes == sorted(info["wnids"]) and len(classes) == 4
    index = {w: i for i, w in enumerate(classes)}
    assert len(val) == 40 and len(train) == 160
    for path, label in val:
        assert label == index[info["val_labels"][os.path.basename(path)]]
    for path, label in train:
        assert classes[label] in path
    # ImageFolder on the raw val folder would give every image label 0
    assert len({label for _, label in val}) == 4


def test_tinyimagenet_reorganised_val_folder(tiny_imagenet, tmp_path):
    root, info = tiny_imagenet
    copy = tmp_path / "tin"
    shutil.copytree(root, copy)
    for name, wnid in info["val_labels"].items():
        (copy / "val" / wnid).mkdir(exist_ok=True)
        shutil.move(copy / "val" / "images" / name, copy / "val" / wnid / name)
    (copy / "val" / "val_annotations.txt").unlink()
    (copy / "val" / "images").rmdir()
    classes, _, val = tinyimagenet.scan_tinyimagenet(copy)
    index = {w: i for i, w in enumerate(classes)}
    assert sorted((os.path.basename(p), l) for p, l in val) == \
        sorted((n, index[w]) for n, w in info["val_labels"].items())


def test_tinyimagenet_training_learns(tiny_imagenet):
    root, _ = tiny_imagenet
    proc = run_script("ddp_train.py", ["--data-dir", str(root), "--model", "resnet18",
                                       "--epochs", "4", "--batch-size", "16", "--lr", "0.02",
                                       "--num-workers", "1"], nproc=2)
    check_ok(proc)
    ms = metrics(proc.stdout)
    assert ms[-1]["dataset"] == "tinyimagenet" and ms[-1]["val_images"] == "40"
    assert "4 classes" in proc.stdout
    best = max(float(m["val_acc"]) for m in ms)
    assert best >= 60.0, proc.stdout  # chance is 25%


def test_srun_without_torchrun_uses_slurm_variables(tmp_path):
    """Two processes started the way `srun python ddp_train.py` starts them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = env_for_tests({"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                             "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_NNODES": "1",
                             "SLURM_JOB_ID": "123", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, str(REPO / "ddp_train.py"), *FAST],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    m = metrics(outs[0][0])[-1]
    assert m["world_size"] == "2" and m["train_images"] == "256"
    assert "ranks from slurm" in outs[0][0]
    assert metrics(outs[1][0]) == []  # only rank 0 prints


def test_dist_env_ignores_batch_step(monkeypatch):
    """In the batch script (no SLURM_STEP_ID) SLURM_NTASKS describes the whole job: a plain
    `python ddp_train.py` there must run alone instead of waiting for peers."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert distributed.dist_env().world_size == 1


@pytest.mark.parametrize("local_world", ["0", "3"])
def test_a_local_world_size_that_cannot_be_is_one_sentence(monkeypatch, local_world):
    """LOCAL_WORLD_SIZE=0 was a ZeroDivisionError traceback where the loader's workers are
    shared out; more processes on the node than in the whole job cannot be either."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": local_world}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(faults.UsageError, match=rf"^\$LOCAL_WORLD_SIZE={local_world} is not a "
                                                r"number of processes on this node \(1 to "
                                                r"WORLD_SIZE=2\)"):
        distributed.dist_env()


BAD_INPUTS = [
    (["--data-dir", "/nonexistent/tiny"], "does not exist"),
    (["--dataset", "tinyimagenet"], "needs --data-dir"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}/afile"], "is a file, not a folder"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--model", "cnn", "--synthetic-size", "64", "--batch-size", "100"], "lower --batch-size"),
    (["--model", "no_such_net"], "unknown --model"),
    (["--model", "vit_b_16"], "--model vit_b_16 cannot take this dataset's 3x64x64 images"),
    (["--dataset", "mnist", "--model", "cnn"], "1x28x28: choose --model mnist_net"),
    (["--check", "--profile", "{tmp}/trace"], "nothing for --profile to trace"),
    (["--seed", "-1"], "--seed cannot be negative"),
    (["--momentum", "-1"], "--momentum cannot be negative"),
    (["--weight-decay", "-1"], "--weight-decay cannot be negative"),
    (["--gamma", "0"], "--gamma must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),
    # scaled past float32 at the start: a RuntimeError traceback in the optimizer's first step
    (["--lr", "1e38", "--lr-scaling", "linear", "--base-batch", "8"], "--lr 1e+38 scaled by "
     "--lr-scaling linear to the global batch of 64 (8e+38) must be below the largest float32"),
    (["--log-every", "-1"], "--log-every cannot be negative, got -1.0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1, got 0"),
    (["--warmup-epochs", "nan"], "--warmup-epochs must be 0 or a positive number"),
    (["--dist-timeout", "99999999999"], "--dist-timeout is in seconds and at most 86400"),
    (["--dist-timeout", "-5"], "--dist-timeout is in seconds and at most 86400 (a day) and at "
                               "least 1, got -5"),
    (["--save-model", "{tmp}"], "is a folder: give a file name"),
    (["--save-model", "{tmp}/afile/model.pt"], "is a file, not a folder"),
    (["--save-model", "{tmp}/ck", "--checkpoint-dir", "{tmp}/ck"], "is the --checkpoint-dir"),
]


@pytest.fixture(scope="module")
def bad_input_runs(request, tmp_path_factory):
    def run(case: dict):
        tmp_path, args = tmp_path_factory.mktemp("bad_input"), case["args"]
        if args[:2] == ["--dataset", "mnist"]:
            args = args + ["--data-dir", str(tmp_path)]
        (tmp_path / "keep.txt").write_text("a user's file")
        (tmp_path / "afile").write_text("not a folder")
        args = [a.replace("{tmp}", str(tmp_path)) for a in args]
        return tmp_path, run_script("ddp_train.py", args + ["--epochs", "1"], timeout=120)
    return runs_two_at_a_time(request, "test_bad_input_exits_2_with_one_line", run)


@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(args, message, bad_input_runs, request):
    tmp_path, proc = bad_input_runs[request.node.callspec.id].result()
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len([l for l in proc.stderr.splitlines() if l.startswith("error:")]) == 1
    assert (tmp_path / "keep.txt").read_text() == "a user's file"  # nothing lost


def test_a_rank_started_by_hand_says_its_own_setup_error():
    """Ranks started by hand (RANK, WORLD_SIZE in each shell) may differ in their setup: rank 1
    with a bad flag (or no MASTER_PORT) exited 2 without a word, as torchrun's silent ranks do,
    and rank 0 waited --dist-timeout for it. It says its error now, with its rank."""
    proc = run_script("ddp_train.py", ["--batch-size", "0"], timeout=120,
                      env={"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})
    assert proc.returncode == 2, proc.stderr
    assert [l for l in proc.stderr.splitlines() if l.startswith("error:")] == [
        "error: rank 1: --batch-size must be at least 1, got 0"], proc.stderr


def _add_annotation(tree, name):
    """A line for ``name`` (``{wnid}`` filled with the second class) at val_annotations.txt's
    end, as an edit by hand or a merge of two files would leave."""
    wnid = (tree / "wnids.txt").read_text().split()[1]
    with open(tree / "val" / "val_annotations.txt", "a") as f:
        f.write(f"{name.format(wnid=wnid)}\t{wnid}\t0\t0\t63\t63\n")


def _broken_tree(src, dst, damage):
    shutil.copytree(src, dst)
    damage(dst)
    return dst


@pytest.fixture(scope="module")
def malformed_runs(request, tiny_imagenet, tmp_path_factory):
    def run(case: dict):
        bad = _broken_tree(tiny_imagenet[0], tmp_path_factory.mktemp("malformed") / "bad",
                           case["damage"])
        return run_script("ddp_train.py", ["--data-dir", str(bad), "--epochs", "1"], timeout=120)
    return runs_two_at_a_time(request, "test_malformed_tinyimagenet_exits_2", run)


@pytest.mark.parametrize("damage,message", [
    (lambda d: shutil.rmtree(d / "train"), "train is missing"),
    (lambda d: (d / "val" / "val_annotations.txt").unlink(), "val_annotations.txt is missing"),
    (lambda d: (d / "wnids.txt").unlink(), "wnids.txt is missing"),
    (lambda d: (d / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99999999\t0\t0\n"),
     "not in wnids.txt"),
    (lambda d: (d / "train" / "n00000001" / "images").mkdir(parents=True), "not listed in"),
    (lambda d: (d / "wnids.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff"),
     "wnids.txt is not a text file (bytes that are not UTF-8 at offset 0)"),
    (lambda d: (d / "val" / "val_annotations.txt").write_bytes(b"val_0.JPEG\t\xff\xfe\n"),
     "val_annotations.txt is not a text file (bytes that are not UTF-8 at offset 11)"),
    # the same image under a second class: it was counted twice, with two labels
    (lambda d: _add_annotation(d, "val_0.JPEG"), "names val_0.JPEG again (line 1 named it "
                                                 "first), and an image has one label"),
    # a training image made a validation one
    (lambda d: _add_annotation(d, "../../train/{wnid}/images/{wnid}_0.JPEG"),
     "a path, where val/images/ holds its images by file name"),
])
def test_malformed_tinyimagenet_exits_2(malformed_runs, request, damage, message):
    proc = malformed_runs[request.node.callspec.id].result()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("below, suffix, dataset", [
    ("", ".gz", "fashion-mnist (or, for MNIST's digits, --dataset mnist with the files in "
                "DIR/MNIST/raw)"),  # the folder itself: the names do not tell the two apart
    ("FashionMNIST/raw", "", "fashion-mnist"), ("MNIST/raw", "", "mnist")])
def test_a_folder_of_idx_files_says_which_dataset_to_add(tmp_path, below, suffix, dataset):
    """Before: --data-dir /usr/share/datasets/fashion-mnist without --dataset said wnids.txt
    is missing and asked for the tiny-imagenet-200 folder. Files of the names Fashion-MNIST's
    and MNIST's have (empty here: the names are what is read) get the flag to add."""
    folder = tmp_path / below
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (folder / f"{name}{suffix}").write_bytes(b"")
    proc = run_script("ddp_train.py", ["--data-dir", str(tmp_path), "--epochs", "1"],
                      timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {folder} holds MNIST-format IDX files, not TinyImageNet (no "
                      f"wnids.txt): train on them with --dataset {dataset}, which reads them as "
                      f"they are (no cache to build)"], proc.stderr


@pytest.mark.parametrize("out, flags, message", [
    ("tree", ["--classes", "0"], "--classes must be at least 1, not 0"),   # ZeroDivisionError
    ("afile", ["--classes", "2"], "afile is a file, not a folder"),        # NotADirectoryError
    ("afile/tree", ["--classes", "2"], "cannot write the tree into"),
])
def test_make_tinyimagenet_refuses_bad_input_in_one_line(tmp_path, out, flags, message):
    (tmp_path / "afile").write_text("a user's file")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "make_tinyimagenet.py"),
                           str(tmp_path / out), *flags], capture_output=True, text=True,
                          env=env_for_tests(), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr.splitlines()[-1], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written
    assert (tmp_path / "afile").read_text() == "a user's file"


def test_cifar10_without_network_says_where_to_put_files(tmp_path):
    proc = run_script("ddp_train.py", ["--dataset", "cifar10", "--data-dir", str(tmp_path),
                                       "--epochs", "1"], timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cifar-10-python.tar.gz" in proc.stderr and "Traceback" not in proc.stderr


def test_more_processes_than_gpus_is_a_usage_error(monkeypatch, capsys):
    import ddp_train
    fake_gpus(monkeypatch, 2)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                 "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    assert ddp_train.main(FAST) == 2
    err = capsys.readouterr().err
    assert "4 processes were started on this node but only 2 GPU(s)" in err
    assert "--nproc-per-node 2" in err


def test_bad_flag_is_rejected_by_argparse():
    proc = run_script("ddp_train.py", ["--no-such-flag"], timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
    # under torchrun, which exits 1 for any failed worker, the worker says its code for job.sh
    proc = run_script("ddp_train.py", ["--no-such-flag"], nproc=1, timeout=120)
    assert proc.returncode == 1 and "unrecognized arguments" in proc.stderr
    assert contract.EXIT_LINE.format(code=2, rank=0) in proc.stdout


def test_cache_and_folder_paths_give_the_same_pixels_and_labels(tiny_imagenet, tmp_path):
    """--data-cache must not change what the model sees: same labels, same pixels before
    augmentation, and the on-device augmentation is a crop of the zero-padded image, flipped
    or not, exactly as the PIL path does it."""
    import argparse
    root, _ = tiny_imagenet
    args = argparse.Namespace(data_dir=str(root), dataset="tinyimagenet", model="resnet18",
                              image_size=None,
                              data_on_device=False,
                              strict=False, num_workers=1, data_cache=str(tmp_path / "c"),
                              seed=0)
    cached = datasets.build_data(args)
    args.data_cache = None
    folder = datasets.build_data(args)
    assert cached.train.targets == folder.train.targets
    assert cached.val.targets == folder.val.targets
    norm = cached.device_augment
    idx = list(range(len(folder.val)))
    u8, labels = cached.val[idx]
    assert labels.tolist() == folder.val.targets
    got = norm(u8, train=False)
    want = torch.stack([folder.val[i][0] for i in idx])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # training pixels: the un-augmented folder image (ToTensor + Normalize) vs the cache
    from torchvision import transforms as T
    plain = T.Compose([T.ToTensor(), T.Normalize(*datasets.NORMALIZE["tinyimagenet"])])
    tr_u8, _ = cached.train[list(range(8))]
    from PIL import Image
    for i in range(8):
        with Image.open(folder.train.samples[i][0]) as img:
            ref = plain(img.convert("RGB"))
        torch.testing.assert_close(norm(tr_u8[i:i + 1], train=False)[0], ref, atol=1e-5, rtol=0)
    # augmentation: every output is one of the 2 x 81 crops/flips of the padded image
    torch.manual_seed(0)
    aug = norm(tr_u8[:4], train=True)
    base = norm(tr_u8[:4], train=False)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in datasets.NORMALIZE["tinyimagenet"])
    padded = torch.nn.functional.pad(base * std + mean, (4, 4, 4, 4))
    padded = (padded - mean) / std
    for b in range(4):
        found = any(torch.allclose(aug[b], c, atol=1e-5)
                    for dy in range(9) for dx in range(9)
                    for c in (padded[b, :, dy:dy + 64, dx:dx + 64],
                              padded[b, :, dy:dy + 64, dx:dx + 64].flip(-1)))
        assert found, f"sample {b} is not a padded crop (or its flip)"


def test_cache_is_reused_and_rebuilt_when_the_data_changes(tiny_imagenet, tmp_path):
    root, info = tiny_imagenet
    data = tmp_path / "tin"
    shutil.copytree(root, data)
    args = ["--data-dir", str(data), "--data-cache", "--model", "resnet18", "--epochs", "1",
            "--batch-size", "16", "--max-steps-per-epoch", "1", "--num-workers", "0"]
    first = run_script("ddp_train.py", args)
    check_ok(first)
    assert "data cache: building train" in first.stdout
    assert (tmp_path / "tin-cache" / "train_u8.npy").is_file()  # beside the data
    second = run_script("ddp_train.py", args)
    check_ok(second)
    assert "data cache: building" not in second.stdout  # reused
    wnid = sorted(info["wnids"])[1]
    os.remove(data / "train" / wnid / "images" / f"{wnid}_3.JPEG")
    third = run_script("ddp_train.py", args)
    check_ok(third)
    assert "data cache: building train" in third.stdout and "159 train" in third.stdout


@pytest.mark.parametrize("cached", [False, True])
def test_started_loader_drops_its_early_batches(tiny_imagenet, tmp_path, cached):
    """The validation loader forks its workers before training (see make_loader); the
    batches they prefetch then must not leak into evaluation: every epoch yields each
    sample exactly once, in sampler order."""
    import argparse
    root, _ = tiny_imagenet
    args = argparse.Namespace(data_dir=str(root), dataset="tinyimagenet", model="resnet18",
                              image_size=None,
                              data_on_device=False,
                              strict=False, num_workers=1, seed=0,
                              data_cache=str(tmp_path / "c") if cached else None)
    data = datasets.build_data(args)
    sampler = DistributedSampler(data.val, num_replicas=1, rank=0, shuffle=False)
    loader = loading.make_loader(data.val, sampler, 7, args, torch.device("cpu"),
                                 start_now=True)
    assert loader._iterator is not None and loader._iterator._workers[0].is_alive()
    for _ in range(2):
        labels = torch.cat([y for _, y in loader]).tolist()
        assert labels == data.val.targets


def test_resnets_start_each_residual_block_as_the_identity():
    """Goyal et al.'s zero init of each block's last BatchNorm: it keeps the demo's first
    validation loss near chance (ln 200 = 5.3) instead of 208-256 from BatchNorm running
    statistics that a few dozen steps have not settled (measured with ResNet-50)."""
    from training import models
    resnet = models.build_model("resnet50", 200, (3, 64, 64))
    blocks = [b for layer in (resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4)
              for b in layer]
    assert len(blocks) == 16 and all(not b.bn3.weight.detach().any() for b in blocks)
    assert resnet.bn1.weight.detach().all()  # the stem is untouched
    other = models.build_model("mobilenet_v3_small", 10, (3, 64, 64))  # no such option there
    assert sum(p.numel() for p in other.parameters()) > 0
