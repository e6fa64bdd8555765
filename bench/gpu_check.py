"""The GPU acceptance run: one command that fits a short GPU allocation, one markdown table.

    python bench/gpu_check.py --out bench/results/gpu.md          # at most 8 minutes
    python bench/gpu_check.py --minutes 20 --rows all --data-dir /data/tiny-imagenet-200

What it does: a list of rows, most telling first, each in its own process with its own
timeout. A row is started only when the time left of --minutes is at least what it needs, so a
short allocation ends with the rows that matter most; each finished row is appended at once to
a JSON-lines file beside --out (and the markdown report rewritten), so a run cut short keeps
every row it finished.

The rows (--rows speed, the default; ResNet-50, bf16 unless said):
- ddp_train.py on synthetic data held on the device (no loader, no copy: the compute ceiling)
  at 64 x 64 pixels, batch 256 eagerly and with --cuda-graph (both with --profile, which counts
  the host's kernel launches per step), 1024 both ways, 2048 eagerly; fp16 (fused SGD, no host
  sync); the CUDA equivalence tests (tests marked cuda_ok: DDP, FSDP, ZeRO-1, DataParallel and
  --cuda-graph against eager); at 224 x 224 DDP eagerly and with --cuda-graph, FSDP full;
  FSDP full and DataParallel (one GPU) at 64 px; --compile at 1024; the launchers on a real GPU
  (launch/local.sh with its nvidia-smi and psrecord logs, then analyze_memory.py --plot on
  them); the input paths: the uint8 cache, held on the device, the JPEG folder.
- Each training row runs two epochs of --steps steps (100 by default) and is timed over the
  second, as the scripts time every epoch: the device synchronised before its first batch and
  after its last step, so over 100 steps the host clock measures what the GPU did. The first
  epoch holds every warm-up: cuDNN's autotuning, --cuda-graph's eager steps and capture,
  --compile's compilation.
- --rows memory: every strategy and ZeRO rung (dp, ddp, ddp --zero1, fsdp grad-op, full, full
  --offload) at 64 and 224 pixels on the cache path, the measured peak
  (torch.cuda.max_memory_allocated) beside the one its run predicted ([MEMORY] line).
- --suite: also the whole test suite on this node (its runs on the CPU; 20 minutes or more).

Without a GPU it still runs (CI smoke-tests it): a small tree, ResNet-18, a few steps; the
CUDA-only rows are listed as skipped. Exit code 0 when every row that ran passed, 1 otherwise
(the table says which failed), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from training import contract, flags  # noqa: E402
from make_tinyimagenet import make_tree, make_tree_parallel  # noqa: E402

CEILING = "ddp, synthetic on device"
GRAPH = "ddp --cuda-graph, synthetic on device"


@dataclass
class Row:
    label: str
    batch: int
    script: str = "ddp_train.py"
    args: list = field(default_factory=list)
    image: int = 64
    cuda_only: bool = False
    needs_data: bool = False  # the TinyImageNet tree and its cache
    need_s: int = 45  # what the row takes on one GPU, about: it starts only with this much left
    kind: str = "train"  # or "held" (--simulate-world-size), "tests", "shared tests",
    # "launcher", "kill-resume"


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


def plan(which: str, gpu: bool) -> list:
    """The rows of ``which`` (speed, memory, all), most telling first."""
    small, big, huge = (256, 1024, 2048) if gpu else (8, 16, 32)
    side = 224 if gpu else 96  # the seed's setting (the CPU smoke run: smaller)
    synth, graph, profile = ["--data-on-device"], ["--cuda-graph"], ["--profile", "{work}"]
    wide = ["--image-size", str(side)]
    one_gpu = ["--gpus", "1"] if gpu else []
    speed = [
        Row(CEILING, small, args=synth + profile),
        Row(GRAPH, small, args=synth + graph + profile, cuda_only=True),
        Row(CEILING, big, args=synth),
        Row(GRAPH, big, args=synth + graph, cuda_only=True),
        Row(CEILING, huge, args=synth, cuda_only=True),
        Row("ddp fp16 (fused SGD), synthetic on device", small,
            args=synth + ["--amp", "fp16"], cuda_only=True),
        Row("equivalence tests on CUDA", 0, kind="tests", cuda_only=True, need_s=240),
        # 224 px: what the seed trains on (on the CPU too slow to tell anything)
        Row(CEILING, small, args=synth + wide, image=side, cuda_only=True),
        Row(GRAPH, small, args=synth + wide + graph, image=side, cuda_only=True),
        # profiled: where FSDP's step loses to DDP's on one GPU (the [PROFILE] breakdown)
        Row("fsdp full, synthetic on device", small, "fsdp_train.py",
            synth + wide + ["--sharding", "full"] + profile, image=side, cuda_only=True),
        Row("fsdp full, synthetic on device", small, "fsdp_train.py",
            synth + ["--sharding", "full"]),
        # offload's gradient shards on the CPU under fp16's GradScaler: gloo beside NCCL
        Row("fsdp --offload fp16, synthetic on device", small, "fsdp_train.py",
            synth + ["--offload", "--amp", "fp16"], cuda_only=True),
        Row("dp (one GPU), synthetic on device", small, "dp_train.py", synth + one_gpu),
        Row("ddp --compile, synthetic on device", big, args=synth + ["--compile"],
            cuda_only=True, need_s=240),
        Row("launchers: local.sh, its memory logs, analyze_memory.py --plot", small,
            kind="launcher", need_s=75),
        Row("kill and resume: fsdp_train.py, 2 ranks sharing the GPU", 16, "fsdp_train.py",
            kind="kill-resume", need_s=90),
        Row("ddp, cache", small, args=["{data}", "{cache}"], needs_data=True),
        Row("ddp, cache held on device", big, args=["{data}", "{cache}", "--data-on-device"],
            needs_data=True),
        Row("ddp, JPEG folder", small, args=["{data}"], needs_data=True),
    ] + [Row(f"ddp --compile {mode}, synthetic on device", big, args=synth + ["--compile", mode],
             cuda_only=True, need_s=300)
         for mode in ("reduce-overhead", "max-autotune-no-cudagraphs")]
    rungs = [("dp", "dp_train.py", one_gpu), ("ddp", "ddp_train.py", []),
             ("ddp --zero1", "ddp_train.py", ["--zero1"]),
             ("fsdp grad-op", "fsdp_train.py", ["--sharding", "grad-op"]),
             ("fsdp full", "fsdp_train.py", ["--sharding", "full"]),
             ("fsdp full --offload", "fsdp_train.py", ["--offload"])]
    # one GPU as rank 0 of 8 (--simulate-world-size): what each ZeRO rung leaves on a GPU of 8
    at_8 = [Row(f"memory at 8 GPUs: {label}", small, script, synth + extra + (
                [] if px == 64 else ["--image-size", str(px)]) + ["--simulate-world-size", "8"],
                image=px, kind="held", need_s=40)
            for px in (64, side) for label, script, extra in rungs[1:]]
    speed.insert(speed.index(next(r for r in speed if r.kind == "tests")) + 1,
                 Row("equivalence tests, 2 ranks sharing a GPU", 0, kind="shared tests",
                     cuda_only=True, need_s=240))
    after_224 = speed.index(next(r for r in speed if r.script == "fsdp_train.py")) + 1
    speed[after_224:after_224] = at_8
    memory = [Row(f"memory: {label}", small, script, ["{data}", "{cache}"] + extra
                  + ([] if px == 64 else ["--image-size", str(px)]), image=px, needs_data=True)
              for px in (64, side) for label, script, extra in rungs]
    return {"speed": speed, "memory": memory, "all": speed + memory}[which]


def row_args(row: Row, model: str, steps: int, paths: dict) -> list:
    """The training script's arguments: two epochs of ``steps`` steps; synthetic data sized to
    one epoch's batches (a quarter more for validation)."""
    args = []
    for a in row.args:
        if a == "{data}":
            args += ["--data-dir", paths["data"]]
        elif a == "{cache}":
            args += ["--data-cache", paths["cache"]]
        else:
            args.append(a.format(work=paths["profile"]))
    if not row.needs_data:  # a simulated rank 0 of 8 reads 1/8 of the samples
        ranks = 8 if "--simulate-world-size" in args else 1
        args += ["--synthetic-size", str(row.batch * max(steps, 2) * ranks)]
    return ["--model", model, "--epochs", "2", "--max-steps-per-epoch", str(steps),
            "--batch-size", str(row.batch), "--log-every", "0"] + args


def _first(lines: list, prefix: str) -> dict | None:
    """The key=value fields of the first ``prefix`` line among ``lines``, or None."""
    return next((found for found, _ in filter(None, (contract.fields(line, prefix)
                                                      for line in lines))), None)


def _failure(proc: subprocess.CompletedProcess, what: str = "exit") -> str:
    """A failed run in one line: its exit code and the last line it printed."""
    last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
    return f"{what} {proc.returncode}: {last[:200]}"


def run_training(row: Row, args: list, timeout: float) -> dict:
    """One training run: the second epoch's [METRIC] figures, the [MEMORY] prediction and the
    [PROFILE] launches per step; a "held" row (--simulate-world-size): the [MEMORY] prediction
    and the [MEMORY-HELD] figures; or the reason it failed."""
    cmd = [sys.executable, str(REPO / row.script), *args]
    # --compile: torch logs each recompilation, to count those inside the timed epoch
    env = dict(os.environ, TORCH_LOGS="recompiles") if "--compile" in args else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s", "cmd": cmd}
    out = proc.stdout.splitlines()
    predicted = _first(out, contract.MEMORY_PREFIX) or {}
    if row.kind == "held":
        held = _first(out, contract.MEMORY_HELD_PREFIX)
        if proc.returncode != 0 or not (predicted and held):
            return {"error": _failure(proc), "cmd": cmd}
        states = ("params_mib", "grads_mib", "optimizer_mib", "host_mib")
        return {"peak": contract.number(held["peak_mib"]) or 0.0,
                "predicted": contract.number(predicted["peak_mib"]),
                "states": " + ".join(f"{held[k]}" for k in states),
                "predicted_states": " + ".join(f"{predicted[k]}" for k in states),
                "units_in_flight": held["units_in_flight"], "amp": predicted["amp"],
                "cmd": cmd}
    rows = [m for m in map(contract.parse_metric_line, out) if m]
    if proc.returncode != 0 or not rows:
        return {"error": _failure(proc), "cmd": cmd}
    m = rows[-1]
    profile = _first(out, contract.PROFILE_PREFIX) or {}
    steps = float(m["train_images"]) / float(m["global_batch"])
    return {"img_s": float(m["throughput_img_s"]), "amp": m["amp"],
            "step_ms": 1e3 * float(m["epoch_time_s"]) / steps, "steps": int(steps),
            "peak": float(m["peak_mem_mib"]),
            "predicted": contract.number(predicted.get("peak_mib")),
            "launches": contract.number(profile.get("launches_per_step")),
            "recompiles_timed": recompiles_between(proc.stderr, float(m["train_start_unix"]),
                                                   float(m["eval_start_unix"]))
            if env else None, "cmd": cmd}


def recompiles_between(log: str, start: float, end: float) -> int:
    """How many "Recompiling function" lines of TORCH_LOGS=recompiles carry a time between
    ``start`` and ``end`` (Unix seconds): torch's log prefix gives month, day and local time."""
    count = 0
    year = datetime.date.today().year
    for match in re.finditer(r"^\S*[IWEV](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) .*Recompiling "
                             r"function", log, re.M):
        month, day, clock = match.groups()
        when = datetime.datetime.strptime(f"{year}-{month}-{day} {clock}",
                                          "%Y-%m-%d %H:%M:%S.%f").timestamp()
        count += start <= when <= end
    return count


def _pytest(args: list, env: dict, timeout: float) -> tuple:
    """(passed, pytest's last line, its FAILED/ERROR lines): which test failed, not only how
    many."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        return False, f"no result within {timeout:.0f} s", []
    lines = proc.stdout.strip().splitlines() or ["no output"]
    failed = [line[:300] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return proc.returncode == 0, lines[-1], failed[:10]


def equivalence_tests(gpus: int, timeout: float, shared: bool = False) -> tuple:
    """The suite's equivalence tests (marked cuda_ok), run on this machine's device (CUDA
    here): the strategies against DDP, and --cuda-graph against the eager step. ``shared``:
    the strategies' tests at 2 ranks on however many GPUs there are (--share-gpus, gloo)."""
    if importlib.util.find_spec("pytest") is None:  # run as python -m pytest below
        return None, "skipped: pytest is not installed (pip install -r requirements-test.txt)"
    nproc = 2 if gpus >= 2 or shared else 1
    # without DPT_TEST_DEVICE=cuda the tests hide the GPUs from their runs (tests/conftest.py)
    env = dict(os.environ, DPT_TEST_NPROC=str(nproc), DPT_TEST_DEVICE="cuda",
               DPT_TEST_SHARE_GPUS="1" if shared else "0")
    # test_hangs.py: NCCL's flight recorder dump read back by the code that names a hang
    files = ([] if shared else [str(REPO / "tests" / "test_cuda_graph.py"),
                                str(REPO / "tests" / "test_hangs.py")]) + [
        str(REPO / "tests" / "test_strategies.py")]
    passed, summary, failed = _pytest(files + ["-m", "cuda_ok"], env, timeout)
    how = "2 ranks sharing the GPU(s), gloo" if shared and gpus < 2 else "NCCL"
    return passed, "; ".join([f"{summary} ({nproc} process(es) per run, {how})"] + failed)


def whole_suite(timeout: float) -> tuple:
    """The whole test suite, as a workshop runs it on a GPU node: it must pass or skip with a
    reason there (its runs stay on the CPU: tests/conftest.py hides the GPUs from them). The
    Slurm lab tests are left out: they start a Slurm cluster, as root, and test no GPU."""
    if importlib.util.find_spec("pytest") is None:
        return None, "skipped: pytest is not installed (pip install -r requirements-test.txt)"
    env = {k: v for k, v in os.environ.items() if k not in ("DPT_TEST_DEVICE", "DPT_TEST_NPROC")}
    env["LAUNCHER_TESTS_SLURM"] = "0"
    passed, summary, failed = _pytest(["-ra", str(REPO / "tests")], env, timeout)
    return passed, "; ".join([summary] + failed)


def run_launcher(row: Row, model: str, steps: int, work: Path, keep: Path | None,
                 timeout: float) -> dict:
    """launch/local.sh as a user runs it, a short DDP run with the nvidia-smi and psrecord
    loggers sampling every second, then analyze_memory.py --plot on its run directory. Its
    logs, summary and timeline.png are copied to ``keep``."""
    runs = work / "launcher-runs"
    # this Python's bin folder first: its psrecord and torchrun, as an activated venv has them
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, RUNS_DIR=str(runs), JOB_NAME="gpu-check", LOG_INTERVAL="1",
               PYTHON=sys.executable, STRATEGY="ddp", PATH=path)
    train = ["--model", model, "--epochs", "1", "--max-steps-per-epoch", str(steps),
             "--batch-size", str(row.batch), "--synthetic-size", str(row.batch * steps),
             "--data-on-device", "--log-every", "0"]
    cmd = ["bash", str(REPO / "launch" / "local.sh"), "--nproc-per-node", "1", "--", *train]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s", "cmd": cmd}
    run_dirs = sorted(glob.glob(str(runs / "gpu-check-*")))
    if proc.returncode != 0 or not run_dirs:
        return {"error": _failure(proc, "local.sh exit"), "cmd": cmd}
    run_dir = Path(run_dirs[-1])
    left = max(10.0, timeout - (time.monotonic() - t0))
    summary = subprocess.run([sys.executable, str(REPO / "analyze_memory.py"), "--plot",
                              str(run_dir)], capture_output=True, text=True, timeout=left,
                             cwd=REPO)
    text = (summary.stdout + summary.stderr).strip()
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / "analyze_memory.txt").write_text(text + "\n")
        for pattern in ("gpu_memory/*.csv", "cpu_memory/*.txt", "timeline.png", "train.log"):
            for path in run_dir.glob(pattern):
                shutil.copy(path, keep / path.name)
    if summary.returncode != 0:
        return {"error": f"analyze_memory.py exit {summary.returncode}: "
                         f"{text.splitlines()[-1][:200] if text else 'no output'}", "cmd": cmd}
    return {"summary": [line for line in text.splitlines() if line.startswith("[")],
            "timeline": (run_dir / "timeline.png").is_file(), "cmd": cmd}


def _descendants(pid: int) -> list:
    """The processes below ``pid`` (Linux /proc): torchrun's workers, in sessions of their own."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def run_kill_resume(row: Row, work: Path, gpu: bool, timeout: float) -> dict:
    """A 2-rank FSDP run (sharing the GPU) killed whole after its first checkpoint, as a node
    failure would, then run again: it must resume from that checkpoint and finish."""
    ckpt = work / "kill-resume"
    shutil.rmtree(ckpt, ignore_errors=True)
    args = ["--model", "resnet18", "--synthetic-size", "320", "--batch-size", str(row.batch),
            "--epochs", "2", "--num-workers", "0", "--log-every", "0", "--checkpoint-dir",
            str(ckpt), "--checkpoint-every", "3"] + (["--share-gpus"] if gpu else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / row.script), *args]
    t0 = time.monotonic()
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    while not list(ckpt.glob("ckpt-*")) and first.poll() is None and \
            time.monotonic() - t0 < timeout / 2:
        time.sleep(0.5)
    for pid in _descendants(first.pid) + [first.pid]:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    first.wait()
    while any(Path(f"/proc/{pid}").exists() for pid in _descendants(first.pid)):
        time.sleep(0.2)
    saved = sorted(p.name for p in ckpt.glob("ckpt-*"))
    if not saved:
        return {"error": "no checkpoint before the kill", "cmd": cmd}
    try:
        again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                               timeout=max(10.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        return {"error": "the resumed run gave no result in time", "cmd": cmd}
    resumed = [line for line in again.stdout.splitlines() if "Resumed from epoch" in line]
    if again.returncode != 0 or not resumed:
        return {"error": _failure(again, "resume: exit"), "cmd": cmd}
    return {"passed": True, "text": f"killed after {saved[-1]}; {resumed[0].split(': ')[-1]}"
                                    f", then finished", "cmd": cmd}


def targets(results: list) -> list:
    """Issue 39's targets where their rows ran: (what, met, the figures)."""
    def rate(label, batch, image=64):
        found = [r["img_s"] for r in results if r.get("label") == label
                 and r.get("batch") == batch and r.get("image") == image and "img_s" in r]
        return found[0] if found else None

    checks = []
    graph_256, eager_1024 = rate(GRAPH, 256), rate(CEILING, 1024)
    best_1024 = max(filter(None, (eager_1024, rate(GRAPH, 1024))), default=None)
    if graph_256:
        checks.append(("64 px, batch 256, --cuda-graph >= 35,000 img/s", graph_256 >= 35000,
                       f"{graph_256:,.0f}"))
    if graph_256 and best_1024:
        checks.append(("64 px, batch 256, --cuda-graph >= 0.75x the best batch-1024 rate",
                       graph_256 >= 0.75 * best_1024, f"{graph_256 / best_1024:.2f}x"))
    if best_1024:
        checks.append(("64 px, batch 1024 >= 50,000 img/s", best_1024 >= 50000,
                       f"{best_1024:,.0f}"))
    best_224 = max(filter(None, (rate(CEILING, 256, 224), rate(GRAPH, 256, 224))), default=None)
    if best_224:
        checks.append(("224 px, batch 256 >= 4,800 img/s (H200)", best_224 >= 4800,
                       f"{best_224:,.0f}"))
    fp16, bf16 = rate("ddp fp16 (fused SGD), synthetic on device", 256), rate(CEILING, 256)
    if fp16 and bf16:
        checks.append(("fp16 >= 0.95x bf16 (batch 256)", fp16 >= 0.95 * bf16,
                       f"{fp16 / bf16:.2f}x"))
    fsdp, ddp = rate("fsdp full, synthetic on device", 256, 224), rate(CEILING, 256, 224)
    if fsdp and ddp:
        checks.append(("FSDP full at 224 px >= 0.85x DDP", fsdp >= 0.85 * ddp,
                       f"{fsdp / ddp:.2f}x"))
    return checks


def report(results: list, head: list, gpu: bool, steps: int, tail: list) -> str:
    ceiling = {(r["batch"], r["image"]): r["img_s"] for r in results
               if r["label"] == CEILING and "img_s" in r}
    lines = head + ["", "| configuration | image | batch | amp | img/s | ms/step | launches/step "
                        "| peak memory (MiB) | predicted (MiB) | error | vs ceiling |",
                    "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in results:
        where = f"| {r['label']} | {r['image'] if r['kind'] in ('train', 'held') else ''} | " \
                f"{r['batch'] or ''} |"
        if "img_s" in r:
            key = (r["batch"], r["image"])
            ratio = f"{r['img_s'] / ceiling[key]:.2f}x" if key in ceiling else "n/a"
            predicted, error = "n/a", "n/a"
            if r["predicted"]:
                predicted = f"{r['predicted']:,.0f}"
                error = f"{(r['predicted'] - r['peak']) / r['peak']:+.0%}" if gpu else "n/a"
            launches = "" if r["launches"] is None else f"{r['launches']:,.0f}"
            lines.append(f"{where} {r['amp']} | {r['img_s']:,.0f} | {r['step_ms']:.1f} | "
                         f"{launches} | {r['peak']:,.0f} | {predicted} | {error} | {ratio} |")
        elif "states" in r:  # --simulate-world-size: memory only
            error = (f"{(r['predicted'] - r['peak']) / r['peak']:+.0%}"
                     if gpu and r["peak"] and r["predicted"] else "n/a")
            peak = f"{r['peak']:,.0f}" if r["peak"] else "n/a"  # on a CPU: none measured
            lines.append(f"{where} {r['amp']} | | | | {peak} | {r['predicted'] or 0:,.0f} | "
                         f"{error} | |")
            notes.append(f"{r['label']}, {r['image']} px: held params + grads + optimizer + "
                         f"host {r['states']} MiB, predicted {r['predicted_states']}; FSDP "
                         f"units gathered at once: {r['units_in_flight']}")
        elif "skipped" in r:
            lines.append(f"{where} | {r['skipped']} | | | | | | |")
        elif "error" in r:
            lines.append(f"{where} | FAILED: {r['error']} | | | | | | |")
        else:
            lines.append(f"{where} | {'passed' if r.get('passed') else 'see below'} "
                         f"| | | | | | |")
        if "text" in r:
            notes.append(f"{r['label']}: {r['text']}")
        if r.get("recompiles_timed") is not None:
            notes.append(f"{r['label']}, {r['batch']}: {r['recompiles_timed']} recompilation(s) "
                         f"inside the timed epoch (TORCH_LOGS=recompiles)")
        if "summary" in r:
            notes += [f"{r['label']}: timeline.png {'drawn' if r['timeline'] else 'MISSING'}"]
            notes += [f"    {line}" for line in r["summary"]]
    lines += ["", f"each training row: 2 epochs of {steps} steps, the second timed (device "
                  f"synchronised at both ends); one process" + (", one GPU" if gpu else
                                                                " on the CPU"),
              "launches/step: the host's kernel, copy and graph launches per step, counted by "
              "--profile's trace (5 steps after the warm-up, and after the capture with "
              "--cuda-graph)"]
    lines += (["error: (predicted - measured) / measured peak, measured as "
               "torch.cuda.max_memory_allocated over the second epoch"] if gpu else
              ["peak memory on the CPU is the process's peak RSS: no prediction to compare "
               "it with (error: n/a)"])
    checks = targets(results) if gpu else []
    if checks:
        lines += ["", "targets:"] + [f"- {'met' if ok else 'MISSED'}: {what} ({figure})"
                                     for what, ok, figure in checks]
    return "\n".join(lines + [""] + notes + tail) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=flags.HelpFormatter)
    p.add_argument("--minutes", type=float, default=8,
                   help="time budget: a row is started only while the time left is at least "
                        "what it needs, so the run ends within this (plus one row's overrun at "
                        "most, which its timeout caps)")
    p.add_argument("--rows", choices=("speed", "memory", "all"), default="speed",
                   help="speed: throughput, --cuda-graph, fp16, FSDP, --compile, the "
                        "launchers, the equivalence tests; memory: every strategy's predicted "
                        "against measured peak memory, at 64 and 224 pixels")
    p.add_argument("--data-dir", default=None,
                   help="a TinyImageNet folder (original layout) for the input-path and memory "
                        "rows; default: generate one when such a row is reached")
    p.add_argument("--work-dir", default=None,
                   help="where the generated tree, the cache and the traces go (default: a "
                        "temporary dir)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per epoch of each row (default: 100 on a GPU, 3 on "
                        "the CPU)")
    p.add_argument("--out", default=None,
                   help="write the report (markdown) here, rewritten after every row, and the "
                        "rows as JSON lines beside it (.jsonl), appended as each finishes, and "
                        "the launcher row's logs and timeline in a folder beside it")
    p.add_argument("--row-timeout", type=int, default=180,
                   help="seconds one row may take at most (the time left caps it too)")
    p.add_argument("--suite", action="store_true",
                   help="also run the whole test suite on this node at the end (20 minutes "
                        "or more; not counted in --minutes)")
    p.add_argument("--skip-suite", action="store_true", help=argparse.SUPPRESS)  # the old default
    p.add_argument("--suite-timeout", type=int, default=3600,
                   help="seconds the whole test suite may take")
    args = p.parse_args(argv)
    if args.minutes <= 0 or (args.steps is not None and args.steps < 1):
        p.error("--minutes and --steps must be above 0")
    if args.data_dir and not Path(args.data_dir).is_dir():
        print(f"error: --data-dir {args.data_dir} does not exist: point it at a TinyImageNet "
              f"folder, or leave it out to generate one", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    deadline = t_start + 60 * args.minutes
    gpu = torch.cuda.is_available()
    steps = args.steps or (100 if gpu else 3)
    model = "resnet50" if gpu else "resnet18"
    if not gpu:
        print("notice: no GPU visible: a small CPU smoke run (ResNet-18, a small tree, "
              f"{steps} steps); the CUDA-only rows and the CUDA equivalence tests are skipped",
              flush=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else None
    jsonl = out.with_suffix(".jsonl") if out else work / "rows.jsonl"
    keep = out.with_name(out.stem + "-launcher") if out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("")
    root = Path(args.data_dir) if args.data_dir else work / "tiny-imagenet-200"
    paths = {"data": str(root), "cache": str(work / "cache"), "profile": str(work / "profile")}
    data_ready = False
    cmd = "python bench/gpu_check.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv))
    head = [f"# GPU acceptance run ({model})", ""] + [f"- {v}" for v in versions(gpu)] + [
        f"- command: `{cmd}`"]
    print(f"rows: appended to {jsonl} as each finishes", flush=True)

    results, failed = [], False
    for row in plan(args.rows, gpu):
        result = {"label": row.label, "batch": row.batch, "image": row.image, "kind": row.kind}
        need = row.need_s + (0 if data_ready or not row.needs_data else 120 if gpu else 15)
        left = deadline - time.monotonic()
        if row.cuda_only and not gpu:
            result["skipped"] = "skipped (CUDA only)"
        elif left < need:
            result["skipped"] = (f"not started: {left:.0f} s left of --minutes {args.minutes:g}, "
                                 f"it needs about {need} s")
        else:
            t0 = time.monotonic()
            if row.needs_data and not data_ready:
                error = prepare_data(root, paths, gpu, bool(args.data_dir))
                if error:
                    result["error"] = error
                data_ready = not error
            timeout = max(10.0, min(args.row_timeout, deadline - time.monotonic()))
            if "error" in result:
                pass
            elif row.kind in ("tests", "shared tests"):
                passed, text = equivalence_tests(torch.cuda.device_count(), timeout,
                                                 shared=row.kind == "shared tests")
                result.update(passed=passed, text=text)
                if passed is False:
                    result["error"] = "see below"
            elif row.kind == "kill-resume":
                result.update(run_kill_resume(row, work, gpu, timeout))
            elif row.kind == "launcher":
                result.update(run_launcher(row, model, steps, work, keep, timeout))
            else:
                result.update(run_training(row, row_args(row, model, steps, paths), timeout))
            result["seconds"] = round(time.monotonic() - t0, 1)
        failed = failed or "error" in result
        results.append(result)
        with open(jsonl, "a") as f:  # written at once, so a run cut short keeps this row
            f.write(json.dumps(result | {"cmd": " ".join(map(str, result.get("cmd", [])))})
                    + "\n")
        shown = (f"{result['img_s']:,.0f} img/s, {result['step_ms']:.1f} ms/step"
                 if "img_s" in result else f"held {result['states']} MiB (params + grads + "
                 f"optimizer + host), predicted {result['predicted_states']}"
                 if "states" in result else result.get("error") or result.get("skipped")
                 or result.get("text") or "done")
        print(f"  {row.label}, {row.image} px, batch {row.batch}: {shown}", flush=True)
        if out:
            out.write_text(report(results, head, gpu, steps, []))

    tail = ["", f"rows: {time.monotonic() - t_start:.0f} s of --minutes {args.minutes:g}"]
    if args.suite and gpu and not args.skip_suite:
        print("the test suite on this node (its runs on the CPU) ...", flush=True)
        suite_passed, suite = whole_suite(args.suite_timeout)
        failed = failed or suite_passed is False
        tail.append(f"test suite on this node: {suite}")
    else:
        tail.append("test suite on this node: " + (
            "skipped: no GPU (run it directly: python -m pytest)" if not gpu
            else "not run (--suite runs it)"))
    text = report(results, head, gpu, steps, tail)
    print()
    print(text, end="")
    if out:
        out.write_text(text)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def prepare_data(root: Path, paths: dict, gpu: bool, given: bool) -> str | None:
    """The TinyImageNet tree (unless given) and its uint8 cache, once, outside any timed row;
    an error's text, or None."""
    t0 = time.monotonic()
    if not given and not (root / "wnids.txt").is_file():
        if gpu:
            make_tree_parallel(root, 200, 500, 50)
        else:
            make_tree(root, classes=4, train_per_class=40, val_per_class=10)
        print(f"data: generated {root} in {time.monotonic() - t0:.0f} s", flush=True)
    built = subprocess.run([sys.executable, str(REPO / "ddp_train.py"), "--data-dir", str(root),
                            "--data-cache", paths["cache"], "--check"], capture_output=True,
                           text=True, cwd=REPO)
    if built.returncode != 0:
        last = (built.stderr.strip() or "no output").splitlines()[-1]
        return f"building the cache failed: {last[:200]}"
    print(f"data: cache ready in {paths['cache']} ({time.monotonic() - t0:.0f} s)", flush=True)
    return None


if __name__ == "__main__":
    sys.exit(main())
