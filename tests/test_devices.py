"""A torch build that cannot use the node's GPUs stops the job with one sentence (exit 2) instead
of failing at its first kernel or training on the CPU; --device cpu trains on the CPU on
purpose. The GPU facts (capability, arch list, is_available, the driver) are simulated. And
the suite itself on a GPU node: its runs stay on the CPU, or skip with the reason."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

from training import common, devices, distributed, faults
from conftest import CU130_ARCHS, FAST, REPO, env_for_tests, fake_gpus, run_script

CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
NVIDIA_SMI = """#!/bin/bash
# A node whose driver supports CUDA {driver} and has {gpus} GPU(s)
if [ "$1" = -L ]; then
  for i in $(seq 0 $(({gpus} - 1))); do echo "GPU $i: Tesla V100-SXM2-32GB (UUID: GPU-$i)"; done
  exit 0
fi
echo "| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: {driver}     |"
"""


@pytest.mark.parametrize("capability, arch_list, runs", [
    ((7, 0), CU130_ARCHS, False),   # V100 on pip's CUDA 13 torch: the case
    ((6, 0), CU130_ARCHS, False),   # P100
    ((7, 5), CU130_ARCHS, True),    # T4
    ((8, 9), CU130_ARCHS, True),    # L4: sm_86's code runs on 8.9
    ((9, 0), CU130_ARCHS, True),    # H100
    ((10, 0), CU130_ARCHS, True),   # B200
    ((10, 3), CU130_ARCHS, True),   # B300: sm_100's code
    ((12, 0), CU130_ARCHS, True),   # RTX 50xx
    ((7, 0), CU126_ARCHS, True),    # V100 on the CUDA 12.6 build: the fix
    ((9, 0), CU126_ARCHS, True),
    ((10, 0), CU126_ARCHS, False),  # Blackwell on a build that ends at Hopper, without PTX
    ((12, 0), CU126_ARCHS + ["compute_90"], True),  # ... with Hopper's PTX, compiled for it
    ((8, 0), ["sm_86"], False),     # machine code never runs on an older minor version
    ((9, 0), ["sm_80", "sm_90a"], True),
    ((10, 0), ["sm_90a"], False),   # arch-specific code runs on 9.0 only
    ((10, 3), ["sm_100f"], True),   # family code: the whole 10.x family
    ((9, 0), [], True),             # nothing to compare with: no refusal
    ((9, 0), ["gfx90a", "gfx942"], True),  # ROCm's names
])
def test_kernels_for_a_gpu(capability, arch_list, runs):
    assert devices.has_kernels_for(capability, arch_list) is runs


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("script", ["ddp_train", "dp_train", "fsdp_train"])
def test_a_v100_on_a_cuda13_torch_stops_naming_the_cuda12_build(script, monkeypatch, capsys):
    """torch.cuda.is_available() is True on a V100 with CUDA 13's torch, and every kernel then
    fails ("no kernel image is available"): the run stops before it, naming the build."""
    module = __import__(script)
    fake_gpus(monkeypatch, 1, capability=(7, 0), name="Tesla V100-SXM2-32GB")
    assert module.main(FAST) == 2
    err = one_line_error(capsys)
    assert "Tesla V100-SXM2-32GB has compute capability 7.0" in err
    assert "(CUDA 13.0) has no kernels for it (it was built for sm_75 sm_80" in err
    assert err.rstrip().endswith("pip install torch torchvision --index-url "
                                 "https://download.pytorch.org/whl/cu126")


def test_a_gpu_newer_than_the_build_names_a_newer_build(monkeypatch):
    fake_gpus(monkeypatch, 1, capability=(10, 0), name="NVIDIA B200", arch_list=CU126_ARCHS,
              cuda="12.6")
    with pytest.raises(faults.UsageError, match="built for a newer CUDA: pip install torch "
                                                "torchvision --index-url .*/whl/cu130"):
        devices.use_gpu(argparse.Namespace(device="auto"))


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (9, 0), (10, 0), (12, 0)])
def test_gpus_of_the_build_are_used(monkeypatch, capability):
    fake_gpus(monkeypatch, 8, capability=capability)
    assert devices.use_gpu(argparse.Namespace(device="auto")) is True
    assert devices.use_gpu(argparse.Namespace(device="cuda")) is True
    assert devices.use_gpu(argparse.Namespace(device="cpu")) is False  # the CPU, on purpose


def no_gpu_for_torch(monkeypatch, tmp_path, cuda="13.0", driver=None, listed=0, env=None):
    """torch sees no GPU; the node's driver supports CUDA ``driver`` (a fake nvidia-smi that
    lists ``listed`` GPUs; None: no nvidia-smi); ``env`` adds the job's variables."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS",
                 "SLURM_STEP_GPUS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    path = "/usr/bin:/bin"
    if driver is not None:
        smi = tmp_path / "nvidia-smi"
        smi.write_text(NVIDIA_SMI.format(driver=driver, gpus=listed))
        smi.chmod(0o755)
        path = f"{tmp_path}:{path}"
    monkeypatch.setenv("PATH", path)


@pytest.mark.parametrize("env, listed, given", [
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, "CUDA_VISIBLE_DEVICES=0,1"),
    ({"SLURM_GPUS_ON_NODE": "4"}, 0, "SLURM_GPUS_ON_NODE=4"),
    ({"SLURM_JOB_GPUS": "0"}, 0, "SLURM_JOB_GPUS=0"),
    ({}, 2, "nvidia-smi -L lists 2 GPU(s)"),
])
@pytest.mark.parametrize("script", ["ddp_train", "dp_train", "fsdp_train"])
def test_a_driver_older_than_the_build_stops_the_job(script, env, listed, given, monkeypatch,
                                                     tmp_path, capsys):
    """A GPU job whose driver is older than the build's CUDA: torch sees no GPU and the run
    used to train on the CPU, 100x slower, after a note. Now: why, and the build to install."""
    module = __import__(script)
    no_gpu_for_torch(monkeypatch, tmp_path, driver="12.4", listed=listed, env=env)
    assert module.main(FAST) == 2
    err = one_line_error(capsys)
    assert f"this job was given GPUs ({given}) but torch cannot use them" in err
    assert "is built for CUDA 13.0, but the NVIDIA driver supports CUDA 12.4 at most" in err
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cu126" \
        in err
    assert err.rstrip().endswith("or add --device cpu to train on the CPU on purpose")


@pytest.mark.parametrize("cuda, driver, said", [
    ("13.0", "12.9", "/whl/cu128"),               # a CUDA 12.8+ driver: Blackwell's build too
    ("13.0", "11.8", "ask for a newer driver"),   # no CUDA 12 build runs on it
    (None, "13.0", "is a CPU-only build; install a CUDA build"),
    ("12.6", "12.6", "torch.cuda.is_available() is False"),  # not a version problem
])
def test_why_torch_sees_no_gpu(cuda, driver, said, monkeypatch, tmp_path):
    no_gpu_for_torch(monkeypatch, tmp_path, cuda=cuda, driver=driver,
                     env={"SLURM_GPUS_ON_NODE": "1"})
    with pytest.raises(faults.UsageError, match="given GPUs") as e:
        devices.use_gpu(argparse.Namespace(device="auto"))
    assert said in str(e.value)


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"},
                                 {"CUDA_VISIBLE_DEVICES": "", "SLURM_GPUS_ON_NODE": "2"}])
def test_no_gpus_given_trains_on_the_cpu(env, monkeypatch, tmp_path):
    """A CPU machine, or GPUs hidden on purpose (an empty CUDA_VISIBLE_DEVICES decides, as in
    launch/node.sh): the CPU, as before; --device cuda insists on a GPU."""
    no_gpu_for_torch(monkeypatch, tmp_path, driver="12.4", listed=2, env=env)
    if "CUDA_VISIBLE_DEVICES" not in env:  # nvidia-smi would list the node's GPUs
        monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert devices.use_gpu(argparse.Namespace(device="auto")) is False
    with pytest.raises(faults.UsageError, match="--device cuda, but torch sees no GPU"):
        devices.use_gpu(argparse.Namespace(device="cuda"))


def test_a_job_given_gpus_that_torch_cannot_see_for_real():
    """Given GPU 99, which no machine has, torch sees no GPU for real: the run stops with the
    reason; --device cpu trains on the CPU."""
    args = FAST + ["--epochs", "1", "--max-steps-per-epoch", "2"]
    proc = run_script("ddp_train.py", args, env={"CUDA_VISIBLE_DEVICES": "99"}, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "this job was given GPUs (CUDA_VISIBLE_DEVICES=99)" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_script("ddp_train.py", args + ["--device", "cpu"],
                      env={"CUDA_VISIBLE_DEVICES": "99"}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: --device cpu: training on CPU with the gloo backend" in proc.stdout


def test_dp_gpus_and_device_cpu_contradict(capsys):
    import dp_train
    assert dp_train.main(FAST + ["--gpus", "2", "--device", "cpu"]) == 2
    assert "--gpus 2 asks for GPUs and --device cpu for none" in one_line_error(capsys)


# ---- the suite on a GPU node: its runs stay on the CPU, or skip with the reason
def test_the_suites_runs_stay_on_the_cpu_on_a_gpu_node(tmp_path):
    """On a node whose nvidia-smi lists GPUs (and a Slurm job given them), the suite's runs are
    the CPU runs it was written for: conftest hides the GPUs (an empty CUDA_VISIBLE_DEVICES),
    so two processes never share one GPU, and no run is refused as a job given GPUs it cannot
    use."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(NVIDIA_SMI.format(driver="13.0", gpus=1))
    smi.chmod(0o755)
    proc = run_script("dp_train.py", FAST + ["--epochs", "1", "--max-steps-per-epoch", "2"],
                      env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_GPUS_ON_NODE": "1"},
                      timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: no GPU visible: DataParallel runs on the CPU as a single device" in proc.stdout


def test_on_the_gpu_only_the_tests_that_hold_there_run(tmp_path):
    """DPT_TEST_DEVICE=cuda (bench/gpu_check.py) keeps the GPUs: a CPU test is skipped with the
    reason, and a run of more processes than the machine has GPUs (here: none) too."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         str(REPO / "tests" / "test_strategies.py"), "-k",
         "test_dp_runs_on_cpu or matches_ddp_single_process"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=env_for_tests({"DPT_TEST_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "a CPU test: runs without DPT_TEST_DEVICE=cuda" in proc.stdout
    assert "1 process(es) need as many GPUs; this machine has 0" in proc.stdout


# ---- The oldest torch we claim, and an older one told so --------------------------------------


@pytest.mark.parametrize("torch_version, vision_version, ok", [
    ("2.14.1+cu130", "0.29.1+cu130", True),
    ("2.9.0", "0.24.0", True),
    ("2.10.0a0+git1234", "0.25.0a0", True),
    ("2.8.0+cu128", "0.23.0", False),   # FSDP2 no longer matches DDP's weights
    ("2.6.0", "0.21.0", False),         # every FSDP run fails at its first forward
    ("2.9.1", "0.21.0", False),         # an old torchvision beside a new torch
])
def test_the_version_floor(torch_version, vision_version, ok):
    if ok:
        devices.check_versions(torch_version, vision_version)
        return
    with pytest.raises(faults.UsageError, match=rf"this torch {re.escape(torch_version)} with "
                       rf"torchvision {re.escape(vision_version)} is older than the torch 2\.9 "
                       rf"and torchvision 0\.24 this project needs"):
        devices.check_versions(torch_version, vision_version)


def test_a_cnn_run_reads_torchvisions_version_without_importing_it():
    """The version floor and the start-up line name torchvision's version; importing it cost
    every run's start about 0.1 s more, though only ResNet and the image folders use it."""
    import torchvision
    code = ("import sys\n"
            "from training import devices\n"
            "print(devices.torchvision_version(), 'torchvision' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=env_for_tests()).stdout.split()
    assert out == [torchvision.__version__.split("+")[0], "False"], out


def test_requirements_txt_states_the_same_floor():
    text = (REPO / "requirements.txt").read_text()
    assert f"torch>={devices.MIN_TORCH[0]}.{devices.MIN_TORCH[1]}\n" in text
    assert f"torchvision>={devices.MIN_TORCHVISION[0]}.{devices.MIN_TORCHVISION[1]}\n" in text


@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py", "dp_train.py"])
def test_a_torch_below_the_floor_stops_every_script_with_one_sentence(tmp_path, script):
    """On torch 2.5.1 fsdp_train.py died with an ImportError traceback and ddp_train.py ran
    with no check at all."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "patched_run.py"), "old_torch",
                           str(tmp_path), script, "--epochs", "1"], capture_output=True,
                          text=True, timeout=120, env=env_for_tests())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "this torch 2.5.1 with torchvision" in errors[0], errors
    assert "pip install -r requirements.txt" in errors[0]


@pytest.mark.parametrize("built, gpu, says", [
    ("13.0", False, "| CUDA build 13.0 (no GPU) | python"),  # it said "CUDA 13.0 | NCCL n/a"
    (None, False, "| CPU-only build | python"),
    ("12.4", True, "| CUDA 12.4 | NCCL 2.21.5 | python"),
])
def test_the_start_up_line_says_what_cuda_is_the_builds(monkeypatch, built, gpu, says):
    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    args = argparse.Namespace(amp="off", checkpoint_dir=None)
    first = common.provenance(args, distributed.DistEnv(0, 0, 1, 1, "single"),
                              torch.device("cpu"), "gloo")[0]
    assert says in first and "n/a" not in first
