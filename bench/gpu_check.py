"""The GPU acceptance run: one command, about 6-9 minutes on one GPU, one markdown table.

    python bench/gpu_check.py                          # generates a full-size TinyImageNet tree
    python bench/gpu_check.py --data-dir /data/tiny-imagenet-200 --out bench/results/gpu.md

What it does, in order:
1. the data: a TinyImageNet-layout tree at full size (200 classes x 500 train, 50 val each),
   written in parallel by tests/make_tinyimagenet.py, unless --data-dir is given; then the
   uint8 cache (``--data-cache``), built once;
2. ResNet-50 at 64x64, each row a real run of a training script for two epochs of --steps
   steps, measured on the second (warm: cuDNN autotuning, caches, compilation done):
   ddp_train.py at batch 256 and 1024 on synthetic data generated and held on the device (the
   compute ceiling: no loader, no copy), on the cache path, on the cache held on the device,
   on the JPEG folder path; fp16 and bf16; --compile; fsdp_train.py (full, grad-op) and
   dp_train.py on one GPU;
   then the memory rows: every strategy and ZeRO rung (dp, ddp, ddp --zero1, fsdp grad-op,
   full, full --offload) on the cache path at 64x64 and, with --image-size 224, the seed's
   setting; every row sets the measured peak (torch.cuda.max_memory_allocated) beside the
   peak its run predicted at start (its [MEMORY] line; training/memory.py), and the error;
3. the test suite's DDP / FSDP / DP equivalence tests on CUDA (NCCL; one process per run, two
   when two GPUs are visible; the tests marked cuda_ok, with DPT_TEST_DEVICE=cuda);
4. the whole test suite on this node, as a workshop would run it (its runs on the CPU, with the
   GPUs hidden; the Slurm lab tests are left out: LAUNCHER_TESTS_SLURM=0), unless --skip-suite;
5. one markdown table: configuration, img/s, peak memory (MiB) measured and predicted, ratio
   to the device-synthetic ceiling at the same batch; with the GPU, driver, torch / CUDA /
   cuDNN / NCCL versions. ``--rows memory`` runs the memory rows only, ``--rows speed`` the
   others.

Without a GPU it still runs (CI smoke-tests it): a small tree, ResNet-18, a few steps, and the
CUDA-only rows (fp16, bf16, --compile), the CUDA equivalence tests and the suite are skipped
with a notice. Exit code 0 when every row and test passed, 1 otherwise (the table says which
failed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402


from training import contract, flags  # noqa: E402
from make_tinyimagenet import make_tree, make_tree_parallel  # noqa: E402

CEILING = "synthetic on device"


def versions(gpu: bool) -> list:
    lines = [f"date: {datetime.date.today().isoformat()}", f"host: {platform.node()}",
             f"torch {torch.__version__}, CUDA {torch.version.cuda or 'n/a'}, cuDNN "
             f"{torch.backends.cudnn.version() if gpu else 'n/a'}, NCCL "
             f"{'.'.join(map(str, torch.cuda.nccl.version())) if gpu else 'n/a'}, "
             f"python {platform.python_version()}"]
    if gpu:
        driver = "unknown"
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=30).stdout.split("\n")[0].strip() or driver
        except (OSError, subprocess.SubprocessError):
            pass
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        cc = torch.cuda.get_device_capability(0)
        lines.insert(0, f"GPU: {', '.join(names)} (compute capability {cc[0]}.{cc[1]}), "
                        f"driver {driver}")
    else:
        lines.insert(0, f"no GPU: CPU {platform.machine()}, {len(os.sched_getaffinity(0))} "
                        f"cores")
    return lines


def run_row(script: str, args: list, timeout: int) -> dict:
    """One training run; the second epoch's [METRIC] line, or the reason it failed."""
    cmd = [sys.executable, str(REPO / script), *args]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout} s", "cmd": cmd}
    rows = [m for m in map(contract.parse_metric_line, proc.stdout.splitlines()) if m]
    if proc.returncode != 0 or not rows:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        return {"error": f"exit {proc.returncode}: {last[:200]}", "cmd": cmd}
    m = rows[-1]
    predicted = [found for found, _ in filter(None, (
        contract.fields(line, contract.MEMORY_PREFIX) for line in proc.stdout.splitlines()))]
    return {"img_s": float(m["throughput_img_s"]), "peak": float(m["peak_mem_mib"]),
            "predicted": float(predicted[0]["peak_mib"]) if predicted else None,
            "amp": m["amp"], "seconds": time.monotonic() - t0, "cmd": cmd}


def plan(data: list, cache: list, steps: int, model: str, batches: tuple, which: str,
         big_image: int) -> list:
    """(label, batch, script, args, cuda_only) for every row of ``which`` (speed, memory, all)."""
    rows = []
    small, big = batches
    if which == "memory":
        batches = ()
    for b in batches:
        synth = ["--synthetic-size", str(b * steps), "--data-on-device"]
        rows.append((f"ddp, {CEILING}", b, "ddp_train.py", synth, False))
        rows.append(("ddp, cache", b, "ddp_train.py", data + cache, False))
    rows += [] if which == "memory" else [
        ("ddp, cache held on device", big, "ddp_train.py", data + cache + ["--data-on-device"],
         False),
        ("ddp, JPEG folder", small, "ddp_train.py", data, False),
        ("ddp, cache, fp16", small, "ddp_train.py", data + cache + ["--amp", "fp16"], True),
        ("ddp, cache, bf16", small, "ddp_train.py", data + cache + ["--amp", "bf16"], True),
        ("ddp, cache, --compile", small, "ddp_train.py", data + cache + ["--compile"], True),
        ("fsdp full, cache", small, "fsdp_train.py", data + cache + ["--sharding", "full"], False),
        ("fsdp grad-op, cache", small, "fsdp_train.py", data + cache + ["--sharding", "grad-op"],
         False),
        # one GPU, as every other row: the ratio to the one-GPU ceiling compares like with like
        ("dp, cache", small, "dp_train.py",
         data + cache + (["--gpus", "1"] if torch.cuda.is_available() else []), False),
    ]
    one_gpu = ["--gpus", "1"] if torch.cuda.is_available() else []
    rungs = [("dp", "dp_train.py", one_gpu), ("ddp", "ddp_train.py", []),
             ("ddp --zero1", "ddp_train.py", ["--zero1"]),
             ("fsdp grad-op", "fsdp_train.py", ["--sharding", "grad-op"]),
             ("fsdp full", "fsdp_train.py", ["--sharding", "full"]),
             ("fsdp full --offload", "fsdp_train.py", ["--offload"])]
    for side, b in ((64, small), (big_image, small)) if which != "speed" else ():
        size = ["--image-size", str(side)] if side != 64 else []
        rows += [(f"memory: {label}, {side}px", b, script, data + cache + size + extra, False)
                 for label, script, extra in rungs]
    common_args = ["--model", model, "--epochs", "2", "--max-steps-per-epoch", str(steps)]
    return [(label, b, script, common_args + ["--batch-size", str(b)] + args, cuda_only)
            for label, b, script, args, cuda_only in rows]


def _pytest(args: list, env: dict, timeout: int) -> tuple:
    """(passed, pytest's last line, its FAILED/ERROR lines): which test failed, not only how
    many."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        return False, f"no result within {timeout} s", []
    lines = proc.stdout.strip().splitlines() or ["no output"]
    failed = [line[:300] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return proc.returncode == 0, lines[-1], failed[:10]


def equivalence_tests(gpus: int, timeout: int) -> tuple:
    """The suite's strategy-equivalence tests, run on this machine's device (CUDA here)."""
    if importlib.util.find_spec("pytest") is None:  # run as python -m pytest below
        return None, "skipped: pytest is not installed (pip install -r requirements-test.txt)"
    nproc = 2 if gpus >= 2 else 1
    # without DPT_TEST_DEVICE=cuda the tests hide the GPUs from their runs (tests/conftest.py)
    env = dict(os.environ, DPT_TEST_NPROC=str(nproc), DPT_TEST_DEVICE="cuda")
    passed, summary, failed = _pytest(
        [str(REPO / "tests" / "test_strategies.py"), "-m", "cuda_ok"], env, timeout)
    return passed, "; ".join([f"{summary} ({nproc} process(es) per run, NCCL)"] + failed)


def whole_suite(timeout: int) -> tuple:
    """The whole test suite, as a workshop runs it on a GPU node: it must pass or skip with a
    reason there (its runs stay on the CPU: tests/conftest.py hides the GPUs from them). The
    Slurm lab tests are left out: they start a Slurm cluster, as root, and test no GPU."""
    if importlib.util.find_spec("pytest") is None:
        return None, "skipped: pytest is not installed (pip install -r requirements-test.txt)"
    env = {k: v for k, v in os.environ.items() if k not in ("DPT_TEST_DEVICE", "DPT_TEST_NPROC")}
    env["LAUNCHER_TESTS_SLURM"] = "0"
    passed, summary, failed = _pytest(["-ra", str(REPO / "tests")], env, timeout)
    return passed, "; ".join([summary] + failed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=flags.HelpFormatter)
    p.add_argument("--data-dir", default=None,
                   help="a TinyImageNet folder (original layout); default: generate one")
    p.add_argument("--work-dir", default=None,
                   help="where the generated tree and the cache go (default: a temporary dir)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per epoch of each run (default: 40 on a GPU, 3 on CPU)")
    p.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--row-timeout", type=int, default=300,
                   help="seconds one run may take (the --compile row: 3x)")
    p.add_argument("--skip-suite", action="store_true",
                   help="leave out the whole test suite (step 4: about 22 minutes on 2 CPU "
                        "cores, less with more)")
    p.add_argument("--suite-timeout", type=int, default=3600,
                   help="seconds the whole test suite may take")
    p.add_argument("--rows", choices=("all", "speed", "memory"), default="all",
                   help="speed: the throughput rows; memory: every strategy's predicted "
                        "against measured peak memory, at 64 and 224 pixels")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.data_dir and not Path(args.data_dir).is_dir():
        print(f"error: --data-dir {args.data_dir} does not exist: point it at a TinyImageNet "
              f"folder, or leave it out to generate one", file=sys.stderr)
        return 2
    steps = args.steps or (40 if gpu else 3)
    model, batches = ("resnet50", (256, 1024)) if gpu else ("resnet18", (8, 16))
    if not gpu:
        print("notice: no GPU visible: a small CPU smoke run (ResNet-18, a small tree, "
              f"{steps} steps); the CUDA-only rows and the CUDA equivalence tests are skipped",
              flush=True)
    t_start = time.monotonic()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)

    root = Path(args.data_dir) if args.data_dir else work / "tiny-imagenet-200"
    if not args.data_dir and not (root / "wnids.txt").is_file():
        t0 = time.monotonic()
        if gpu:
            make_tree_parallel(root, 200, 500, 50)
        else:
            make_tree(root, classes=4, train_per_class=40, val_per_class=10)
        print(f"data: generated {root} in {time.monotonic() - t0:.0f} s", flush=True)
    data = ["--data-dir", str(root)]
    cache = ["--data-cache", str(work / "cache")]
    t0 = time.monotonic()  # build the cache once, outside the timed rows
    built = subprocess.run([sys.executable, str(REPO / "ddp_train.py"), *data, *cache,
                            "--check"], capture_output=True, text=True, cwd=REPO)
    if built.returncode != 0:
        print(f"error: building the cache failed:\n{built.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"data: cache ready in {work / 'cache'} ({time.monotonic() - t0:.0f} s)", flush=True)

    results = []
    big_image = 224 if gpu else 96  # the seed's setting (the CPU smoke run: smaller)
    for label, batch, script, row_args, cuda_only in plan(data, cache, steps, model, batches,
                                                          args.rows, big_image):
        if cuda_only and not gpu:
            results.append((label, batch, {"skipped": "CUDA only"}))
            continue
        # --compile: 3x the limit, for the first compilation of the training and eval graphs
        r = run_row(script, row_args, args.row_timeout * (3 if "--compile" in row_args else 1))
        results.append((label, batch, r))
        shown = f"{r['img_s']:.0f} img/s" if "img_s" in r else r["error"]
        print(f"  {label}, batch {batch}: {shown}", flush=True)

    if gpu:
        passed, tests = equivalence_tests(torch.cuda.device_count(), 600)
    else:
        passed, tests = None, "skipped: no GPU (the CPU suite runs them with gloo)"
    if not gpu:
        suite_passed, suite = None, "skipped: no GPU (run it directly: python -m pytest)"
    elif args.skip_suite:
        suite_passed, suite = None, "skipped (--skip-suite)"
    else:
        print("the test suite on this node (its runs on the CPU) ...", flush=True)
        suite_passed, suite = whole_suite(args.suite_timeout)

    ceiling = {b: r["img_s"] for label, b, r in results if label.endswith(CEILING)
               and "img_s" in r}
    cmd = "python bench/gpu_check.py" + "".join(f" {shlex.quote(a)}" for a in (argv or
                                                                             sys.argv[1:]))
    lines = [f"# GPU acceptance run ({model}, 64x64)", ""]
    lines += [f"- {v}" for v in versions(gpu)]
    lines += [f"- command: `{cmd}`",
              f"- each row: 2 epochs of {steps} steps, the second measured; one process"
              + (", one GPU" if gpu else " on the CPU"), ""]
    lines += ["| configuration | batch | amp | img/s | peak memory (MiB) | predicted (MiB) | "
              "error | vs ceiling |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    failed = False
    for label, batch, r in results:
        if "img_s" in r:
            ratio = f"{r['img_s'] / ceiling[batch]:.2f}x" if batch in ceiling else "n/a"
            predicted, error = "n/a", "n/a"
            if r["predicted"]:
                predicted = f"{r['predicted']:,.0f}"
                error = f"{(r['predicted'] - r['peak']) / r['peak']:+.0%}" if gpu else "n/a"
            lines.append(f"| {label} | {batch} | {r['amp']} | {r['img_s']:,.0f} | "
                         f"{r['peak']:,.0f} | {predicted} | {error} | {ratio} |")
        elif "skipped" in r:
            lines.append(f"| {label} | {batch} | | skipped ({r['skipped']}) | | | | |")
        else:
            failed = True
            lines.append(f"| {label} | {batch} | | FAILED: {r['error']} | | | | |")
    if gpu:
        lines += ["", "error: (predicted - measured) / measured peak, measured as "
                      "torch.cuda.max_memory_allocated over the second epoch"]
    else:
        lines += ["", "peak memory on the CPU is the process's peak RSS: no prediction to "
                      "compare it with (error: n/a)"]
    lines += ["", f"equivalence tests on this device: {tests}",
              f"test suite on this node: {suite}",
              f"total: {time.monotonic() - t_start:.0f} s"]
    failed = failed or passed is False or suite_passed is False
    report = "\n".join(lines) + "\n"
    print()
    print(report, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
