"""Shared test helpers: run the training scripts as a user would (python or torchrun), parse
their output with the same parser the project ships, and build a small TinyImageNet tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# The suite runs on the CPU (gloo), on a GPU node too: there its runs would otherwise pick the
# GPU, and tests written for a CPU fail (two one-process "nodes" both take cuda:0, which NCCL
# refuses; two processes share one GPU). Hiding the GPUs from this process and every run it
# starts keeps them CPU runs (an empty CUDA_VISIBLE_DEVICES hides the GPUs on purpose, so the
# scripts do not stop for a job given GPUs it cannot use). DPT_TEST_DEVICE=cuda keeps the GPUs:
# bench/gpu_check.py runs the strategy-equivalence tests on CUDA so.
ON_CUDA = os.environ.get("DPT_TEST_DEVICE") == "cuda"
# With DPT_TEST_SHARE_GPUS=1 (and DPT_TEST_DEVICE=cuda) runs of more processes than GPUs share
# them (--share-gpus, over gloo) instead of being skipped: two ranks on one GPU.
SHARE_GPUS = ON_CUDA and os.environ.get("DPT_TEST_SHARE_GPUS") == "1"
if not ON_CUDA:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(TESTS))

from training import contract  # noqa: E402
from make_tinyimagenet import make_tree  # noqa: E402

EPOCH_RE = re.compile(
    r"^Epoch \[(\d+)/(\d+)\] LR: (\d+\.\d{6}) \| Loss \(train, val\): (\d+\.\d{3}), "
    r"(\d+\.\d{3}) \| Accuracy \(train, val\): (\d+\.\d{2})%, (\d+\.\d{2})% \| "
    r"Throughput: (\d+\.\d) img/s \| Data wait: \d+% \| Images: (\d+)x\d+$", re.M)

# Tiny, fast settings for the CIFAR-10 CNN on synthetic data (fp32, no workers).
FAST = ["--model", "cnn", "--synthetic-size", "256", "--batch-size", "16", "--epochs", "2",
        "--num-workers", "0", "--amp", "off"]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_ok: also runs on the GPU with DPT_TEST_DEVICE=cuda "
                                       "(bench/gpu_check.py); every other test is CPU-only")


def pytest_report_header(config):
    return ("devices: the GPUs are used (DPT_TEST_DEVICE=cuda): only tests marked cuda_ok run"
            if ON_CUDA else "devices: CPU only (GPUs hidden: CUDA_VISIBLE_DEVICES is empty)")


def pytest_collection_modifyitems(config, items):
    """With DPT_TEST_DEVICE=cuda, the tests that hold on a GPU run, the rest is skipped with the
    reason: they were written for the CPU (gloo, two processes on one machine)."""
    if not ON_CUDA:
        return
    skip = pytest.mark.skip(reason="a CPU test: runs without DPT_TEST_DEVICE=cuda (the GPUs are "
                                   "then hidden from it)")
    for item in items:
        if "cuda_ok" not in item.keywords:
            item.add_marker(skip)


def env_for_tests(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in list(env):  # a test run inside a Slurm job or torchrun must not inherit its ranks
        if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                             "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            del env[k]
    env.pop("DATA_DIR", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # On a GPU: cuDNN's fp32 convolutions default to TF32, whose rounding differs between the
    # algorithms cudnn.benchmark picks per process, beyond the equivalence tests' 1e-4
    env["NVIDIA_TF32_OVERRIDE"] = "0"
    env.update(extra or {})
    return env


def run_script(script: str, args=(), nproc: int | None = None, timeout: int = 600,
               env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """`python script args` or, with nproc, `torchrun --standalone --nproc-per-node N ...`.
    On the GPU (DPT_TEST_DEVICE=cuda) a run of more processes than GPUs is skipped: NCCL gives
    each process a GPU of its own."""
    if ON_CUDA and (nproc or 1) > _gpus():
        if not SHARE_GPUS:
            pytest.skip(f"{nproc or 1} process(es) need as many GPUs; this machine has {_gpus()}")
        args = [*args, "--share-gpus"]
    if nproc is None:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(REPO / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env_for_tests(env), cwd=cwd or REPO)


def runs_two_at_a_time(request, test_name: str, run) -> dict:
    """For a module-scoped fixture: ``run(params)`` for each selected case of the parametrized
    ``test_name`` in this module, two at a time, in the order the cases run, started when the
    fixture is first asked for. A one-process run keeps one core busy, mostly with importing
    torch; CI has two. Returns {case id: future}; a test takes its case's result with
    ``runs[request.node.callspec.id].result()``, or the exception its run raised."""
    cases = [item.callspec for item in request.session.items
             if item.module is request.module and item.originalname == test_name]
    pool = ThreadPoolExecutor(2)
    request.addfinalizer(lambda: pool.shutdown(cancel_futures=True))
    return {case.id: pool.submit(run, case.params) for case in cases}


#: The architectures of pip's torch 2.14, built for CUDA 13.0 (torch.cuda.get_arch_list()).
CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def fake_gpus(monkeypatch, n: int, capability=(9, 0), name="NVIDIA H100 80GB HBM3",
              arch_list=CU130_ARCHS, cuda="13.0") -> None:
    """Make torch in this process report ``n`` GPUs of one kind, built for ``arch_list`` with
    CUDA ``cuda``; nothing here reaches a driver."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
    monkeypatch.setattr(torch.version, "cuda", cuda)


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


def metrics(stdout: str) -> list:
    return [m for m in map(contract.parse_metric_line, stdout.splitlines()) if m]


def epoch_lines(stdout: str) -> list:
    return EPOCH_RE.findall(stdout)


def read_until(proc: subprocess.Popen, prefix: str) -> str:
    """Read a running process's text stdout line by line until a line starts with ``prefix``;
    return what was read. Fails (with the output) if the process ends first."""
    head = []
    for line in proc.stdout:
        head.append(line)
        if line.startswith(prefix):
            return "".join(head)
    raise AssertionError(f"the process ended before a line starting with {prefix!r}:\n"
                         + "".join(head))


def wait_for(predicate, timeout=240) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def check_ok(proc: subprocess.CompletedProcess) -> None:
    """The run exited 0; else its output's ends, and where a rank crashed (faulthandler's
    "Fatal Python error", PYTHONFAULTHANDLER=1) the start of that stack, which the two ranks'
    dumps and torchrun's summary push out of the last 3,000 characters."""
    if proc.returncode == 0:
        return
    stderr = proc.stderr or ""
    crash = stderr.find("Fatal Python error")
    first_crash = ("\n--- the first crash ---\n" + stderr[crash:crash + 2000]
                   if crash >= 0 and crash < len(stderr) - 3000 else "")
    raise AssertionError(f"exit {proc.returncode}\n{(proc.stdout or '')[-3000:]}\n"
                         f"{stderr[-3000:]}{first_crash}")


@pytest.fixture(scope="session")
def check_runs():
    """`--check --model cnn` on 2 processes, ddp_train.py's and fsdp_train.py's, run once:
    test_fault_tolerance reads the preflight, test_progress the bandwidth lines."""
    return {script: run_script(script, ["--check", "--model", "cnn"], nproc=2)
            for script in ("ddp_train.py", "fsdp_train.py")}


# launch/run_benchmarks.py --local's study: DDP and FSDP, one and two processes, the CNN.
TINY = ["--model", "cnn", "--synthetic-size", "256", "--epochs", "2", "--num-workers", "0",
        "--amp", "off"]


@pytest.fixture(scope="session")
def local_study(tmp_path_factory):
    """TINY's study, run once: test_run_benchmarks checks, collects and resumes it,
    test_tensorboard opens its runs. Returns (study folder, the completed process)."""
    study = tmp_path_factory.mktemp("local") / "study"
    cmd = [sys.executable, str(REPO / "launch" / "run_benchmarks.py"), "--local", "--study-dir",
           str(study), "--strategies", "ddp", "fsdp", "--gpus", "1", "2", "--nodes", "1",
           "--per-gpu-batch", "16", "--", *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=env_for_tests({"LOG_INTERVAL": "0.5", "CUDA_VISIBLE_DEVICES": ""}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return study, proc


@pytest.fixture(scope="session")
def tiny_imagenet(tmp_path_factory):
    root = tmp_path_factory.mktemp("data") / "tiny-imagenet-200"
    info = make_tree(root, classes=4, train_per_class=40, val_per_class=10)
    return root, info
