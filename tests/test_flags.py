"""Flags that disagree with each other (training/flags.py check_flags, the one check that
training, --estimate-memory and launch/check_args.py share): each is refused with one sentence
whose advice, followed, gives flags that pass; what does nothing is said."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

from training import distributed, flags
from training.faults import UsageError
from conftest import REPO, env_for_tests, run_script


def _parse(script: str, argv: list):
    return importlib.import_module(script).build_parser().parse_args(argv)


def _without(argv: list, gone: list) -> list:
    """argv without the flags ``gone`` and the values that follow them."""
    kept, skipping = [], False
    for a in argv:
        skipping = a in gone or (skipping and not a.startswith("--"))
        if not skipping:
            kept.append(a)
    return kept


def _follow(message: str, argv: list) -> list:
    """The flags after doing what the refusal says: drop the flags it names, or add one."""
    if "drop one of them" in message:  # --offload with another --sharding: drop --offload
        return _without(argv, ["--offload"])
    drop = re.search(r": drop (.+)$", message)
    if drop:
        return _without(argv, drop.group(1).split(" and "))
    return argv + [re.search(r"add (--[a-z-]+)", message).group(1)]


@pytest.mark.parametrize("script, argv, says", [
    ("ddp_train", ["--dataset", "fashion-mnist", "--data-on-device"],
     "--data-on-device works with TinyImageNet's --data-cache and the synthetic dataset, not "
     "--dataset fashion-mnist: drop --data-on-device"),
    # it said "drop --data-cache" here, after saying "add --data-cache" without it
    ("ddp_train", ["--dataset", "fashion-mnist", "--data-on-device", "--data-cache"],
     "drop --data-cache and --data-on-device"),
    ("ddp_train", ["--dataset", "cifar10", "--data-cache"],
     "--data-cache works with TinyImageNet only, not --dataset cifar10: drop --data-cache"),
    ("ddp_train", ["--data-dir", "x", "--data-on-device"], "add --data-cache"),
    ("fsdp_train", ["--sharding", "grad-op", "--offload", "--estimate-memory", "4"],
     "--offload works with --sharding full, not grad-op: drop one of them"),
    ("ddp_train", ["--simulate-world-size", "4", "--tensorboard", "tb"],
     "--simulate-world-size only measures the memory of rank 0 of N (its collectives move no "
     "data): drop --tensorboard"),
])
def test_each_refusal_names_a_fix_that_works(script, argv, says):
    with pytest.raises(UsageError) as refused:
        flags.check_flags(_parse(script, argv))
    assert says in str(refused.value)
    flags.check_flags(_parse(script, _follow(str(refused.value), argv)))  # passes now


@pytest.mark.parametrize("sharding", ["hybrid", "grad-op"])
def test_estimate_memory_refuses_what_training_refuses(sharding):
    """It printed an estimate for --offload with a sharding that training refuses."""
    proc = run_script("fsdp_train.py", ["--estimate-memory", "4", "--sharding", sharding,
                                        "--offload"], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--offload works with --sharding full, not {sharding}" in proc.stderr
    assert "[MEMORY]" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("device_flag, why", [("cpu", "--device cpu"),
                                              ("auto", "no GPU visible")])
def test_share_gpus_on_the_cpu_is_said(capsys, device_flag, why):
    args = _parse("ddp_train", ["--share-gpus", "--device", device_flag])
    flags.check_flags(args)
    flags.resolve_args(args, distributed.DistEnv(0, 0, 2, 2, "torchrun"), torch.device("cpu"))
    out = capsys.readouterr().out
    assert (f"note: --share-gpus does nothing here: the ranks train on the CPU ({why}), each "
            f"on its own cores; drop --share-gpus") in out


def test_estimate_memory_leaves_the_flags_as_resolved(capsys):
    """--estimate-memory assumes a GPU run's --amp bf16 for its figures, on a copy: the flags
    are resolved once (check_flags, then resolve_args after the device) and nothing changes
    them afterwards."""
    from training import memory
    script = importlib.import_module("ddp_train")
    args = _parse("ddp_train", ["--model", "cnn", "--estimate-memory", "1"])
    flags.check_flags(args)
    assert memory.estimate_only(args, script.memory_per_gpu, script.MEMORY_VARIANTS) == 0
    assert "note: --amp bf16 assumed" in capsys.readouterr().out
    assert args.amp is None


@pytest.mark.parametrize("argv, says", [
    # --momentum 2 trained into a NaN loss whose message blamed the learning rate
    (["--momentum", "1"], "--momentum must be below 1 (0.9 is common), got 1.0"),
    # a seed above 64 bits was an OverflowError traceback from torch.Generator
    (["--seed", str(2**64)], f"--seed must be 0 to {2**63 - 1}, got {2**64}"),
    # --save-model onto the checkpoint it resumed from replaced it with the weights alone
    (["--resume", "{ck}", "--save-model", "{ck}"],
     "--save-model {ck} is the checkpoint --resume reads"),
    # --save-model named like a checkpoint in the run's own --checkpoint-dir replaced it
    (["--save-model", "{ck}"], "--save-model {ck} is named like a checkpoint, and --resume "
     "auto would take it for one (in a --checkpoint-dir, it can replace this run's own): give "
     "it another name, e.g. --save-model model.pt"),
    # an OverflowError traceback in the schedule; a silent start-up that filled the memory
    (["--warmup-epochs", "1e308"], "--warmup-epochs must be 0 or a positive number of epochs "
     "up to 1,000,000, got 1e+308"),
    (["--synthetic-size", str(10**12)], "--synthetic-size is at most 100,000,000 images, got "
     "1,000,000,000,000"),
    # --data-dir "$DATA" with DATA unset trained on synthetic data with a note
    (["--data-dir", ""], "--data-dir (or $DATA_DIR, its default) is empty (a variable that "
     "was not set?): give the dataset's folder, or drop --data-dir for built-in synthetic "
     "data"),
    # past float32: a RuntimeError traceback in the optimizer's first step, or at the first
    # decay of the learning rate, after an epoch of training
    (["--lr", "1e39"], "--lr 1e+39 must be below the largest float32, 3.4e+38 (0.01 to 1 is "
                       "common)"),
    (["--weight-decay", "1e39"], "--weight-decay must be below the largest float32"),
    (["--gamma", "1e308", "--step-size", "1", "--epochs", "3"], "--lr 0.01 times --gamma "
     "1e+308 at each of the 3 decays (every --step-size 1 of --epochs 3) goes past the largest "
     "float32 (3.4e+38): use a --gamma below 1"),
])
def test_values_that_fail_later_are_refused_at_the_start(tmp_path, argv, says):
    ck = tmp_path / "ckpt-e0001-s0000000"
    ck.write_bytes(b"")
    argv = [a.replace("{ck}", str(ck)) for a in argv]
    with pytest.raises(UsageError) as refused:
        flags.check_flags(_parse("ddp_train", argv))
    assert says.replace("{ck}", str(ck)) in str(refused.value)


@pytest.mark.parametrize("argv, said", [
    (["--tensorboard-every", "1"], ["note: --tensorboard-every 1 does nothing without "
                                    "--tensorboard: add --tensorboard"]),
    (["--tensorboard-every", "1", "--tensorboard", "tb"], []),
    (["--data-on-device", "--num-workers", "2"], ["note: --num-workers 2 does nothing with "
                                                  "--data-on-device, which reads no batch "
                                                  "through a loader: drop it"]),
    (["--data-on-device"], []),
    # --cuda-graph on the CPU is refused; --compile reduce-overhead ran without a word
    (["--compile", "reduce-overhead"], ["note: --compile reduce-overhead's CUDA graphs do "
                                        "nothing on the CPU: the step compiles without them, "
                                        "as --compile default"]),
    (["--compile"], []),
    (["--dataset", "fashion-mnist", "--data-dir", ".", "--synthetic-size", "100"],
     ["note: --synthetic-size 100 does nothing with --dataset fashion-mnist: it sizes the "
      "built-in synthetic data; drop it"]),
    (["--synthetic-size", "100"], []),
    # fsdp_train.py's: on the CPU it trained without a word, as if it saved memory
    (["fsdp_train", "--offload"], ["note: --offload moves nothing on the CPU, where the "
                                   "shards, gradients and optimizer state are in host memory "
                                   "already (FSDP's offload code still runs)"]),
    (["fsdp_train"], []),
])
def test_flags_that_act_on_nothing_this_run_has_are_said(capsys, monkeypatch, tmp_path, argv,
                                                         said):
    """--tensorboard-every without --tensorboard, --num-workers with --data-on-device were
    taken without a word, as the checkpoint flags without --checkpoint-dir were. (A first
    item "fsdp_train": that script's flags, not ddp_train's.)"""
    monkeypatch.delenv("RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    script, argv = (argv[0], argv[1:]) if argv[:1] == ["fsdp_train"] else ("ddp_train", argv)
    args = _parse(script, argv + ["--device", "cpu"])
    flags.check_flags(args)
    flags.resolve_args(args, distributed.DistEnv(0, 0, 1, 1, "single"), torch.device("cpu"))
    assert [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("note: --")] == said


@pytest.mark.parametrize("argv, said", [
    (["--checkpoint-every", "5"], "note: --checkpoint-every 5 does nothing without "
     "--checkpoint-dir: this run saves no checkpoint; add --checkpoint-dir DIR"),
    (["--checkpoint-every", "5", "--keep-checkpoints", "3"], "note: --checkpoint-every 5 and "
     "--keep-checkpoints 3 do nothing without --checkpoint-dir: this run saves no checkpoint; "
     "add --checkpoint-dir DIR"),
    (["--keep-checkpoints", "3", "--checkpoint-dir", "ck"], None),
    ([], None),
])
def test_checkpoint_flags_without_a_folder_are_said_and_the_stop_line_says_nothing_is_saved(
        capsys, monkeypatch, argv, said):
    """Without --checkpoint-dir, --checkpoint-every and --keep-checkpoints were taken without a
    word, and the start-up line offered to "stop with a checkpoint" that was never written."""
    from training import common
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    args = _parse("ddp_train", argv + ["--device", "cpu"])
    flags.check_flags(args)
    env = distributed.DistEnv(0, 0, 1, 1, "single")
    flags.resolve_args(args, env, torch.device("cpu"))
    notes = [line for line in capsys.readouterr().out.splitlines() if "checkpoint" in line]
    assert notes == ([said] if said else [])
    stop = common.provenance(args, env, torch.device("cpu"), "gloo")[-1]
    assert stop == (f"stop with a checkpoint: kill -TERM {os.getpid()} (or -USR1)"
                    if args.checkpoint_dir else
                    f"stop: kill -TERM {os.getpid()} (or -USR1); nothing is saved without "
                    f"--checkpoint-dir")


@pytest.mark.parametrize("where", ["itself", "above"])
def test_a_file_where_an_output_folder_goes_is_named(tmp_path, where):
    """--checkpoint-dir, --tensorboard or --profile naming a file (or a path through one) said
    "cannot create ... (File exists)" or "(Not a directory)", which named no fix."""
    from training import faults
    (tmp_path / "afile").write_text("")
    path = tmp_path / "afile" / ("" if where == "itself" else "sub")
    with pytest.raises(UsageError) as refused:
        faults.make_folder(path, "--checkpoint-dir")
    assert str(refused.value) == (f"--checkpoint-dir {path}: {tmp_path / 'afile'} is a file, "
                                  f"not a folder: give a folder's path")
    faults.make_folder(tmp_path / "new" / "ck", "--checkpoint-dir")
    assert (tmp_path / "new" / "ck").is_dir()


@pytest.mark.parametrize("script", ["ddp_train.py", "dp_train.py"])
def test_a_refusal_does_not_import_zero_fsdp_or_dtensor(script):
    """A refused flag is said in the time it takes to import torch: ZeRO's package, FSDP's and
    DTensor's (which load each other, about 1 s, a quarter of the refusal) are not imported
    for it."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(REPO / script), "--epochs",
                           "0"], capture_output=True, text=True, timeout=120,
                          env=env_for_tests(), cwd=REPO)
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and said == ["error: --epochs must be at least 1, got 0"], said
    loaded = re.findall(r"\| +(torch\.distributed\.(?:optim|fsdp|tensor))$", done.stderr, re.M)
    assert loaded == [], f"{script} imported {sorted(set(loaded))} to refuse a flag"


@pytest.mark.parametrize("script, argv, said", [
    ("ddp_train.py", ["--epochs", "1", "--nproc-per-node", "2"],
     "error: --nproc-per-node is torchrun's, not ddp_train.py's: put it before the script, as "
     "in torchrun --nproc-per-node ... ddp_train.py ..."),
    ("fsdp_train.py", ["--nnodes=2"], "error: --nnodes is torchrun's, not fsdp_train.py's: put "
     "it before the script, as in torchrun --nnodes ... fsdp_train.py ..."),
    ("dp_train.py", ["--nproc_per_node", "4"], "error: --nproc_per_node is torchrun's, and "
     "dp_train.py runs as one process that drives every GPU: drop it (python dp_train.py ..., "
     "--gpus N picks how many)")])
def test_a_torchrun_flag_after_the_script_is_one_sentence(script, argv, said):
    """`torchrun ddp_train.py --nproc-per-node 2` (or python): argparse's 25-line usage, then
    "unrecognized arguments", and under torchrun its ChildFailedError traceback."""
    from conftest import REPO
    proc = subprocess.run([sys.executable, str(REPO / script), *argv], capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, said + "\n", "")


def test_a_strategys_positive_flag_has_an_upper_bound():
    """--bucket-cap-mb 1e308 passed the type and ended in DDP's OverflowError traceback."""
    assert flags.positive("25") == 25.0
    for text in ("0", "-1", "nan", "inf", "1e308", "abc"):
        with pytest.raises(argparse.ArgumentTypeError, match="above 0 and below 1e12"):
            flags.positive(text)
