"""The GPU acceptance run: one command that fits a short GPU allocation, one markdown table.

    python bench/gpu_check.py --out bench/results/gpu.md          # at most 8 minutes
    python bench/gpu_check.py --out bench/results/gpu.md --continue   # the rows a cut run left
    python bench/gpu_check.py --rows targets --out bench/results/gpu-targets.md  # one lane
    python bench/gpu_check.py --rows compile --minutes 12 --out bench/results/gpu-compile.md
    python bench/gpu_check.py --dry-run                            # the lanes, estimated

What it does: a list of rows, each in its own process with its own timeout, run in lanes. The
timed rows (a training run whose img/s is a figure) run one after another in the first lane;
the untimed rows (the equivalence tests, the shared-GPU tests, the rank-0-of-8 memory rows,
kill-and-resume, the profiled launch counts, the launchers, building the tree) run in the other
lanes beside them, since a peak is per process and a count is a count (--lanes, default 4,
1 with --rows targets; --lanes 1 runs every row alone). A row is started only when the time
left of --minutes is at least its time estimate: the seconds it took in an earlier run (the
JSON lines beside --out, or --estimates), else the plan's guess. Each finished row is appended
at once to a JSON-lines file beside --out with its seconds (and the markdown report
rewritten), so a run cut short keeps every row it finished, and --continue runs only the rows
not yet there.

The rows (--rows speed, the default; ResNet-50, bf16 unless said):
- timed: ddp_train.py on synthetic data held on the device (no loader, no copy: the compute
  ceiling) at 64 x 64 pixels, batch 256 and 1024, eagerly and with --cuda-graph; fp16 (fused
  SGD, no host sync); at 224 x 224 DDP eagerly and with --cuda-graph, FSDP full; then, over
  30-step windows (their figure is no headline), batch 2048, FSDP full, --offload with fp16 and
  DataParallel (one GPU) at 64 px, and the input paths: the uint8 cache, held on the device, the
  JPEG folder.
- untimed: the CUDA equivalence tests (tests marked cuda_ok: DDP, FSDP, ZeRO-1, DataParallel
  and --cuda-graph against eager), the same at 2 ranks sharing the GPU, a 2-rank FSDP run
  killed and resumed, a 2-rank FSDP --save-model run sharing the GPU (the file must load and
  hold every weight whole), the host's kernel launches per step and where a step's time goes
  (--profile, in rows of their own so that no timed row runs under the profiler), one GPU as
  rank 0 of 8 for each ZeRO rung at 64 and 224 px (--simulate-world-size: 2 steps), and the
  launchers on a real GPU (launch/local.sh with its nvidia-smi and psrecord logs, then
  analyze_memory.py --plot on them).
- Each training row runs two epochs and is timed over the second, as the scripts time every
  epoch: the device synchronised before its first batch and after its last step. The headline
  rows run --steps steps an epoch (100 by default), the others 30. The first epoch holds every
  warm-up (cuDNN's autotuning, --cuda-graph's capture, --compile's compilation): the table's
  warm-up column is how much longer it took than the second.
- The rows that start ranks (the equivalence tests, kill-and-resume, --save-model) run with
  PYTHONFAULTHANDLER=1: where a rank crashed (SIGSEGV), the first lines of its Python stack
  are in the row's note. A row that outlives its timeout says where it was: each of its
  training processes prints its Python stacks (SIGUSR2, training/hangs.py) before the row's
  processes are killed, and the row's note keeps the main thread's innermost frames and the
  toolkit's lines below them, beside the last line the row printed.
- --rows targets: only the rows the targets are judged on (the headline timed rows), and the
  raw step at 64 px, batch 256 (bench/raw_step.py: the same model's plain PyTorch step, no
  DDP, no loader, eagerly and as one CUDA graph: the yardstick of --cuda-graph), one lane by
  default (an explicit --lanes still wins), so no other row shares the
  GPU with them: about 7 minutes on an H200 by the plan's guesses.
- --rows compile, an allocation of its own: eager, --cuda-graph and each --compile mode at
  224 px batch 256 (the target's size, first), then at 64 px batch 1024, one after another,
  with a persistent Inductor cache (TORCHINDUCTOR_CACHE_DIR: inductor-cache beside --out), so
  a second run on the same node compiles from it. By the plan's guesses (150 to 360 s a
  compiled row) the 224 px rows take about 20 minutes: --minutes and --continue split them
  over allocations (--dry-run shows where).
- --rows memory: every strategy and ZeRO rung (dp, ddp, ddp --zero1, fsdp grad-op, full, full
  --offload) at 64 and 224 pixels on the cache path, the measured peak
  (torch.cuda.max_memory_allocated) beside the one its run predicted ([MEMORY] line).
- --suite: also the whole test suite on this node (its runs on the CPU; 20 minutes or more).

Without a GPU it still runs (CI smoke-tests it): a small tree, ResNet-18, a few steps; the
CUDA-only rows are listed as skipped. Exit code 0 when every row that ran passed, 1 otherwise
(the table says which failed), 2 for a bad command line. Ctrl-C or SIGTERM (an allocation's
end) starts no more rows and ends the running ones: the report keeps the rows that ended,
the cut ones are marked interrupted, --continue runs them again; exit code 130 (SIGINT) or
143 (SIGTERM).
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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from bench import raw_step  # noqa: E402
from bench.gpu_plan import (DATA, WINDOW, Row, plan, raw_args, row_args, row_key,  # noqa: E402
                            row_steps)
from bench.gpu_report import in_one_line, report  # noqa: E402
from bench.lanes import CAUGHT, INTERRUPTED, catch_stops, print_plan, run_lanes  # noqa: E402
from bench.process_tree import (FAULTHANDLER, STOP, RowTimeout, end_tree, exited,  # noqa: E402
                                fatal_stack, run_command)
from training import contract, flags, models  # noqa: E402
from make_tinyimagenet import make_tree, make_tree_parallel  # noqa: E402


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


def run_raw(row: Row, args: list, timeout: float) -> dict:
    """bench/raw_step.py: its [RAW] line's img/s and ms a step, or the reason it failed."""
    cmd = [sys.executable, str(REPO / row.script), *args]
    try:
        proc = run_command(cmd, timeout)
    except RowTimeout as late:
        return late.result(cmd)
    raw = _first(proc.stdout.splitlines(), raw_step.RAW_PREFIX)
    if proc.returncode != 0 or not raw:
        return {"error": _failure(proc), "cmd": cmd}
    return {"img_s": float(raw["img_per_s"]), "step_ms": float(raw["ms_per_step"]),
            "amp": raw["amp"], "steps": int(raw["steps"]), "warmup_s": None,
            "peak": float(raw["peak_mib"]), "predicted": None, "cmd": cmd}


def _first(lines: list, prefix: str) -> dict | None:
    """The key=value fields of the first ``prefix`` line among ``lines``, or None."""
    return next((found for found, _ in filter(None, (contract.fields(line, prefix)
                                                      for line in lines))), None)


def _failure(proc: subprocess.CompletedProcess, what: str = "exit") -> str:
    """A failed run in one line: its exit code and the last line it printed."""
    last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
    return f"{what} {proc.returncode}: {last[:200]}"


def run_training(row: Row, args: list, timeout: float, inductor_cache: Path | None = None
                 ) -> dict:
    """One training run: the second epoch's [METRIC] figures, how much longer the first epoch
    took (its warm-up) and the [MEMORY] prediction; a "profile" row: the [PROFILE] step
    breakdown and launches per step; a "held" row (--simulate-world-size): the [MEMORY]
    prediction and the [MEMORY-HELD] figures; or the reason it failed."""
    cmd = [sys.executable, str(REPO / row.script), *args]
    env = None
    if "--compile" in args:
        # torch logs each recompilation, to count those inside the timed epoch; Inductor's
        # cache outlives the run, so the next run of the row compiles from it
        env = dict(os.environ, TORCH_LOGS="recompiles")
        if inductor_cache is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    try:
        proc = run_command(cmd, timeout, env)
    except RowTimeout as late:
        return late.result(cmd)
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
    if row.kind == "profile":
        profile = _first(out, contract.PROFILE_PREFIX)
        if proc.returncode != 0 or not (rows and profile):
            return {"error": _failure(proc), "cmd": cmd}
        parts = {k: contract.number(profile[k]) for k in contract.PROFILE_KEYS}
        return {"amp": rows[-1]["amp"], "launches": parts.pop("launches_per_step"),
                "profile": parts, "cmd": cmd}
    if proc.returncode != 0 or not rows:
        return {"error": _failure(proc), "cmd": cmd}
    m = rows[-1]
    steps = float(m["train_images"]) / float(m["global_batch"])
    warmup = None
    if rows[0]["epoch"] != m["epoch"]:  # the first epoch's extra time: every warm-up
        warmup = float(rows[0]["epoch_time_s"]) - float(m["epoch_time_s"])
    return {"img_s": float(m["throughput_img_s"]), "amp": m["amp"],
            "step_ms": 1e3 * float(m["epoch_time_s"]) / steps, "steps": int(steps),
            "warmup_s": warmup, "peak": float(m["peak_mem_mib"]),
            "predicted": contract.number(predicted.get("peak_mib")),
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
    """(passed, pytest's last line, its FAILED/ERROR lines, the first crash's stack): which
    test failed, not only how many, and where a crashed rank was."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        return False, f"no result within {timeout:.0f} s", [], []
    lines = proc.stdout.strip().splitlines() or ["no output"]
    failed = [line[:300] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return (proc.returncode == 0, lines[-1], failed[:10],
            fatal_stack(proc.stdout + "\n" + proc.stderr))


def equivalence_tests(gpus: int, timeout: float, shared: bool = False) -> tuple:
    """The suite's equivalence tests (marked cuda_ok), run on this machine's device (CUDA
    here): the strategies against DDP, and --cuda-graph against the eager step. ``shared``:
    the strategies' tests at 2 ranks on however many GPUs there are (--share-gpus, gloo).
    Returns (passed, the summary, the first crash's stack)."""
    if importlib.util.find_spec("pytest") is None:  # run as python -m pytest below
        return (None, "skipped: pytest is not installed (pip install -r "
                      "requirements-test.txt)", [])
    nproc = 2 if gpus >= 2 or shared else 1
    # without DPT_TEST_DEVICE=cuda the tests hide the GPUs from their runs (tests/conftest.py)
    env = dict(os.environ, DPT_TEST_NPROC=str(nproc), DPT_TEST_DEVICE="cuda",
               DPT_TEST_SHARE_GPUS="1" if shared else "0", **FAULTHANDLER)
    # test_hangs.py: NCCL's flight recorder dump read back by the code that names a hang
    files = ([] if shared else [str(REPO / "tests" / "test_cuda_graph.py"),
                                str(REPO / "tests" / "test_hangs.py")]) + [
        str(REPO / "tests" / "test_strategies.py")]
    passed, summary, failed, fatal = _pytest(files + ["-m", "cuda_ok"], env, timeout)
    how = "2 ranks sharing the GPU(s), gloo" if shared and gpus < 2 else "NCCL"
    return passed, "; ".join([f"{summary} ({nproc} process(es) per run, {how})"] + failed), fatal


def whole_suite(timeout: float) -> tuple:
    """The whole test suite, as a workshop runs it on a GPU node: it must pass or skip with a
    reason there (its runs stay on the CPU: tests/conftest.py hides the GPUs from them). The
    Slurm lab tests are left out: they start a Slurm cluster, as root, and test no GPU."""
    if importlib.util.find_spec("pytest") is None:
        return None, "skipped: pytest is not installed (pip install -r requirements-test.txt)"
    env = {k: v for k, v in os.environ.items() if k not in ("DPT_TEST_DEVICE", "DPT_TEST_NPROC")}
    env["LAUNCHER_TESTS_SLURM"] = "0"
    passed, summary, failed, _ = _pytest(["-ra", str(REPO / "tests")], env, timeout)
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
        proc = run_command(cmd, timeout, env)
    except RowTimeout as late:
        return late.result(cmd)
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


def two_ranks(script: str, args: list) -> list:
    """torchrun's command for 2 ranks of ``script`` on this node."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(REPO / script), *args]


def run_kill_resume(row: Row, work: Path, gpu: bool, timeout: float) -> dict:
    """A 2-rank FSDP run (sharing the GPU) killed whole after its first checkpoint, as a node
    failure would, then run again: it must resume from that checkpoint and finish."""
    ckpt = work / "kill-resume"
    shutil.rmtree(ckpt, ignore_errors=True)
    args = ["--model", "resnet18", "--synthetic-size", "320", "--batch-size", str(row.batch),
            "--epochs", "2", "--num-workers", "0", "--log-every", "0", "--checkpoint-dir",
            str(ckpt), "--checkpoint-every", "3"] + (["--share-gpus"] if gpu else [])
    cmd = two_ranks(row.script, args)
    env = dict(os.environ, **FAULTHANDLER)
    t0 = time.monotonic()
    first_log = work / "kill-resume-first.log"  # where a crash before the kill says where
    with open(first_log, "w") as log:
        first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)
    while not list(ckpt.glob("ckpt-*")) and first.poll() is None and not STOP.is_set() and \
            time.monotonic() - t0 < timeout / 2:
        time.sleep(0.5)
    killed = end_tree(first.pid)  # as a node failure would: no rank gets to save
    first.wait()
    deadline = time.monotonic() + 10
    while not all(map(exited, killed)) and time.monotonic() < deadline:  # ranks, workers
        time.sleep(0.2)
    saved = sorted(p.name for p in ckpt.glob("ckpt-*"))
    if STOP.is_set():  # the run is being interrupted: no new torchrun now
        return {"error": "interrupted before the resumed run", "cmd": cmd}
    if not saved:
        return {"error": "no checkpoint before the kill", "cmd": cmd,
                "fatal": fatal_stack(first_log.read_text(errors="replace"))}
    try:
        again = run_command(cmd, max(10.0, timeout - (time.monotonic() - t0)), env)
    except RowTimeout as late:
        return late.result(cmd) | {"error": f"the resumed run: {late}"}
    resumed = [line for line in again.stdout.splitlines() if "Resumed from epoch" in line]
    if again.returncode != 0 or not resumed:
        return {"error": _failure(again, "resume: exit"), "cmd": cmd,
                "fatal": fatal_stack(again.stderr)}
    return {"passed": True, "text": f"killed after {saved[-1]}; {resumed[0].split(': ')[-1]}"
                                    f", then finished", "cmd": cmd}


def run_save_model(row: Row, work: Path, gpu: bool, timeout: float) -> dict:
    """A short 2-rank FSDP run of the CIFAR CNN (sharing the GPU) with --save-model: it must
    exit 0 and leave a file that torch.load reads, holding every weight whole (unsharded: the
    shapes of the model's own state dict)."""
    path = work / "save-model" / "model.pt"
    shutil.rmtree(path.parent, ignore_errors=True)
    path.parent.mkdir(parents=True)
    args = ["--model", "cnn", "--synthetic-size", str(4 * row.batch), "--batch-size",
            str(row.batch), "--epochs", "1", "--max-steps-per-epoch", "2", "--num-workers", "0",
            "--log-every", "0", "--save-model", str(path)] + (["--share-gpus"] if gpu else [])
    cmd = two_ranks(row.script, args)
    try:
        proc = run_command(cmd, timeout, dict(os.environ, **FAULTHANDLER))
    except RowTimeout as late:
        return late.result(cmd)
    if proc.returncode != 0:
        return {"error": _failure(proc), "cmd": cmd, "fatal": fatal_stack(proc.stderr)}
    wrong = whole_weights("cnn", path)
    if wrong:
        return {"error": wrong, "cmd": cmd}
    return {"passed": True, "text": f"{path.name} loads with torch.load and holds every "
                                    f"weight whole", "cmd": cmd}


def whole_weights(model: str, path: Path) -> str | None:
    """What is wrong with the --save-model file at ``path``, or None: it must load with
    torch.load (weights only) and hold every tensor of ``model``'s state dict at its full
    shape, as plain tensors (a DTensor is a shard)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a missing or unreadable file: the row fails, saying why
        return f"torch.load({path.name}) failed: {type(exc).__name__}: {str(exc)[:200]}"
    shape, classes = models.synthetic_shape(model)
    full = {name: tuple(t.shape) for name, t in
            models.build_model(model, classes, shape).state_dict().items()}
    got = {name: tuple(t.shape) for name, t in saved.items() if type(t) is torch.Tensor}
    wrong = sorted((set(full) ^ set(got)) | {k for k in full.keys() & got.keys()
                                             if full[k] != got[k]})
    if wrong:
        return (f"{path.name} does not hold the whole weights: {len(wrong)} of {len(full)} "
                f"differ or are missing ({', '.join(wrong[:3])})")
    return None


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


def missing_input(args, jsonl: Path | None) -> str | None:
    """What a path of the command line lacks, in one sentence that names the fix, or None."""
    if args.data_dir and not Path(args.data_dir).is_dir():
        return (f"--data-dir {args.data_dir} does not exist: point it at a TinyImageNet "
                f"folder, or leave it out to generate one")
    if args.continue_run and not (jsonl and jsonl.is_file()):
        where = f"at {jsonl}" if jsonl else "without --out"
        return (f"--continue reads the rows of an earlier run beside --out, and there are "
                f"none {where}: give the --out of that run, or drop --continue")
    if args.estimates and not Path(args.estimates).is_file():
        return (f"--estimates {args.estimates} does not exist: give the .jsonl an earlier "
                f"run wrote beside its --out, or leave it out")
    return None


def earlier_rows(args, jsonl: Path | None) -> tuple:
    """(the rows of the earlier runs, those of them --continue keeps): --estimates' and the
    JSON lines beside --out; a line a cut run left half written is left out, with a notice."""
    earlier, kept = [], []
    for path in filter(None, (Path(args.estimates) if args.estimates else None, jsonl)):
        if path.is_file():
            found, broken = read_rows(path)
            earlier += found
            if broken:
                print(f"notice: {path}: {broken} line(s) not a whole row (a run cut while "
                      f"writing), left out", flush=True)
            if args.continue_run and path == jsonl:
                kept = [r for r in found if finished(r)]
    return earlier, kept


def read_rows(path: Path) -> tuple:
    """The rows of the JSON lines at ``path`` and how many lines were not a whole row (a run
    cut while writing leaves half a line at the end)."""
    rows, broken = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            broken += 1
            continue
        if isinstance(row, dict) and {"label", "image", "batch"} <= row.keys():
            rows.append(row)
        else:
            broken += 1
    return rows, broken


def finished(row: dict) -> bool:
    """Whether an earlier run's row has its result (passed, failed or not for this device),
    so --continue leaves it; a row "not started", or cut by an interruption, runs."""
    return not str(row.get("skipped", "")).startswith(("not started", INTERRUPTED))


def measured_seconds(rows: list, device: str) -> dict:
    """{(key, steps per epoch): seconds} of the rows an earlier run ran on ``device``: the
    time estimates of the same rows in this run."""
    return {(row_key(r["label"], r["image"], r["batch"]), r.get("steps_per_epoch")): r["seconds"]
            for r in rows if r.get("device") == device and r.get("seconds") is not None
            and "skipped" not in r}  # a cut row's seconds say nothing of the row


def main(argv=None) -> int:
    """The run (``acceptance_run``), with the signal handlers it sets put back after it."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return acceptance_run(argv)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def parser() -> argparse.ArgumentParser:
    """gpu_check's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=flags.HelpFormatter)
    p.add_argument("--minutes", type=float, default=8,
                   help="time budget: a row is started only while the time left is at least "
                        "its time estimate, and its timeout ends with the budget, so the run "
                        "ends within this")
    p.add_argument("--rows", choices=("speed", "targets", "memory", "compile", "all"),
                   default="speed",
                   help="speed: throughput, --cuda-graph, fp16, FSDP, the "
                        "launchers, the equivalence tests, rank 0 of 8; targets: only the rows "
                        "the targets are judged on (the headline timed rows and the raw step), "
                        "one lane by default, for undisturbed figures (about 7 minutes on an "
                        "H200); memory: every strategy's predicted against measured peak "
                        "memory, at 64 and 224 pixels; compile: eager, --cuda-graph and each "
                        "--compile mode (an allocation of its own)")
    p.add_argument("--lanes", type=int, default=None,
                   help="rows run at once: the timed rows one after another in the first lane, "
                        "the untimed rows (tests, profiles, memory, launchers) in the others; "
                        "1: every row alone, in the plan's order (default: 1 with --rows "
                        "targets, else 4)")
    p.add_argument("--continue", dest="continue_run", action="store_true",
                   help="keep the rows in the JSON lines beside --out and run only those not "
                        "there yet (a row that was not started runs); the report has both")
    p.add_argument("--estimates", default=None,
                   help="the JSON lines of an earlier run whose measured seconds are this "
                        "run's time estimates (default: those beside --out, if any)")
    p.add_argument("--dry-run", action="store_true",
                   help="print which row runs in which lane and when, by the time estimates, "
                        "and run nothing")
    p.add_argument("--data-dir", default=None,
                   help="a TinyImageNet folder (original layout) for the input-path and memory "
                        "rows; default: generate one when such a row is reached")
    p.add_argument("--work-dir", default=None,
                   help="where the generated tree, the cache and the traces go (default: a "
                        "temporary dir)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per epoch of each headline row, at most {WINDOW} for "
                        f"the others (default: 100 on a GPU, 3 on the CPU)")
    p.add_argument("--out", default=None,
                   help="write the report (markdown) here, rewritten after every row, and the "
                        "rows as JSON lines beside it (.jsonl), appended as each finishes, and "
                        "the launcher row's logs and timeline in a folder beside it; the "
                        "--compile rows keep Inductor's cache in inductor-cache beside it")
    p.add_argument("--row-timeout", type=int, default=180,
                   help="seconds one row may take at most, or twice its time estimate where "
                        "that is more (the time left caps it too)")
    p.add_argument("--suite", action="store_true",
                   help="also run the whole test suite on this node at the end (20 minutes "
                        "or more; not counted in --minutes)")
    p.add_argument("--skip-suite", action="store_true", help=argparse.SUPPRESS)  # the old default
    p.add_argument("--suite-timeout", type=int, default=3600,
                   help="seconds the whole test suite may take")
    return p


def acceptance_run(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    catch_stops()  # from here on, Ctrl-C and SIGTERM end the run with its report written
    if args.lanes is None:  # the target rows alone: no other row beside them on the GPU
        args.lanes = 1 if args.rows == "targets" else 4
    if args.minutes <= 0 or (args.steps is not None and args.steps < 1) or args.lanes < 1:
        p.error("--minutes, --steps and --lanes must be above 0")
    out = Path(args.out) if args.out else None
    jsonl = out.with_suffix(".jsonl") if out else None
    wrong = missing_input(args, jsonl)
    if wrong:
        print(f"error: {wrong}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    deadline = t_start + 60 * args.minutes
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    steps = args.steps or (100 if gpu else 3)
    model = "resnet50" if gpu else "resnet18"
    rows = plan(args.rows, gpu)

    earlier, kept = earlier_rows(args, jsonl)
    seconds = measured_seconds(earlier, device)

    def need(row: Row) -> float:
        return seconds.get((row.key, row_steps(row, steps)), row.need_s)

    done = {row_key(r["label"], r["image"], r["batch"]) for r in kept}
    results = list(kept)
    pending = []
    for row in rows:
        if row.key in done:
            continue
        if row.cuda_only and not gpu:
            results.append({"label": row.label, "batch": row.batch, "image": row.image,
                            "kind": row.kind, "skipped": "skipped (CUDA only)"})
        else:
            pending.append(row)
    first_data = next((i for i, row in enumerate(pending) if row.needs_data), None)
    if first_data is not None:  # one lane: just before the first row that needs it
        pending.insert(0 if args.lanes > 1 else first_data,
                       Row(DATA, 0, kind="data", need_s=40 if gpu else 15))

    if args.dry_run:
        measured = sum((row.key, row_steps(row, steps)) in seconds for row in pending)
        print(f"plan: --rows {args.rows}, --minutes {args.minutes:g}; time estimates: "
              f"{measured} measured before, the rest the plan's guesses"
              + (f"; {len(kept)} row(s) kept from the earlier run" if kept else "")
              + (f"; {len(results) - len(kept)} row(s) CUDA only, skipped"
                 if len(results) > len(kept) else ""))
        print_plan(pending, args.lanes, 60 * args.minutes, need)
        return 0

    if not gpu:
        print("notice: no GPU visible: a small CPU smoke run (ResNet-18, a small tree, "
              f"{steps} steps); the CUDA-only rows and the CUDA equivalence tests are skipped",
              flush=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    jsonl = jsonl or work / "rows.jsonl"
    keep = out.with_name(out.stem + "-launcher") if out else None
    inductor_cache = (out.parent if out else work) / "inductor-cache"
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    # the kept rows rewritten whole: a half line a cut run left is gone before any is appended
    # (through a new file: a stop while writing cannot cut the earlier run's rows short)
    fresh = jsonl.with_name(jsonl.name + ".new")
    fresh.write_text("".join(json.dumps(r) + "\n" for r in results))
    os.replace(fresh, jsonl)
    root = Path(args.data_dir) if args.data_dir else work / "tiny-imagenet-200"
    paths = {"data": str(root), "cache": str(work / "cache"), "profile": str(work / "profile")}
    data_notes, data_error = [], []
    cmd = "python bench/gpu_check.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv))
    head = [f"# GPU acceptance run ({model})", ""] + [f"- {v}" for v in versions(gpu)] + [
        f"- command: `{cmd}`"] + ([f"- continued: {len(kept)} row(s) from the earlier run in "
                                   f"{jsonl.name}"] if args.continue_run else [])
    print(f"rows: appended to {jsonl} as each finishes; {len(pending)} job(s) in "
          f"{args.lanes} lane(s)", flush=True)
    order = {row.key: i for i, row in enumerate(rows)}

    def in_plan_order(found: list) -> list:
        return sorted(found, key=lambda r: order.get(row_key(r["label"], r["image"], r["batch"]),
                                                     len(order)))

    def run_row(row: Row) -> dict:
        timeout = max(10.0, min(max(args.row_timeout, 2 * need(row)),
                                deadline - time.monotonic()))
        if row.kind == "data":
            error = prepare_data(root, paths, gpu, bool(args.data_dir))
            return {"error": error} if error else {}
        if row.needs_data and data_error:
            return {"error": data_error[0]}
        if row.kind in ("tests", "shared tests"):
            passed, text, fatal = equivalence_tests(torch.cuda.device_count(), timeout,
                                                    shared=row.kind == "shared tests")
            return dict(passed=passed, text=text, fatal=fatal) | (
                {"error": "see below"} if passed is False else {})
        if row.kind == "kill-resume":
            return run_kill_resume(row, work, gpu, timeout)
        if row.kind == "save-model":
            return run_save_model(row, work, gpu, timeout)
        if row.kind == "raw":
            return run_raw(row, raw_args(row, model, row_steps(row, steps), gpu), timeout)
        if row.kind == "launcher":
            return run_launcher(row, model, row_steps(row, steps), work, keep, timeout)
        return run_training(row, row_args(row, model, row_steps(row, steps), paths), timeout,
                            inductor_cache)

    lane_seconds = [0.0] * args.lanes
    ended = []  # the rows of this run that ended (not cut by a stop)

    def record(row: Row, result: dict) -> None:
        lane_seconds[result["lane"]] += result["seconds"]
        if row.kind == "data":
            note = result.get("error") or result.get("skipped") or "ready"
            data_notes.append(f"{row.label}: {note} "
                              f"({result['seconds']:.0f} s, lane {result['lane']})")
            print(f"  {data_notes[-1]}", flush=True)
            data_error.extend([result["error"]] if "error" in result else [])
            return
        result = {"label": row.label, "batch": row.batch, "image": row.image,
                  "kind": row.kind, "timed": row.in_timed_lane, "device": device,
                  "steps_per_epoch": row_steps(row, steps)} | result
        results.append(result)
        ended.extend([] if "skipped" in result else [row.key])
        with open(jsonl, "a") as f:  # written at once, so a run cut short keeps this row
            f.write(json.dumps(result | {"cmd": " ".join(map(str, result.get("cmd", [])))})
                    + "\n")
        print(f"  {row.key}: {in_one_line(result)} ({result['seconds']:.0f} s, lane "
              f"{result['lane']})", flush=True)
        if out:
            out.write_text(report(in_plan_order(results), head, gpu, steps, []))

    left = run_lanes(pending, args.lanes, deadline, need, run_row, record)
    unstarted = [{"label": row.label, "batch": row.batch, "image": row.image,
                  "kind": row.kind, "skipped": "not started: the run was interrupted"
                  if STOP.is_set() else f"not started: --minutes {args.minutes:g} had no "
                  f"{need(row):.0f} s left for it"}
                 for row in left if row.kind != "data"]
    results += unstarted
    with open(jsonl, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in unstarted)
    failed = any("error" in r for r in results)

    tail = ["", f"rows: {time.monotonic() - t_start:.0f} s of --minutes {args.minutes:g}, "
                f"{args.lanes} lane(s) busy " + ", ".join(f"{s:.0f}" for s in lane_seconds)
                + " s"]
    tail += data_notes
    if args.suite and gpu and not args.skip_suite and not STOP.is_set():
        print("the test suite on this node (its runs on the CPU) ...", flush=True)
        suite_passed, suite = whole_suite(args.suite_timeout)
        failed = failed or suite_passed is False
        tail.append(f"test suite on this node: {INTERRUPTED if STOP.is_set() else suite}")
    else:
        tail.append("test suite on this node: " + (
            "not run: the run was interrupted" if STOP.is_set() and args.suite
            else "skipped: no GPU (run it directly: python -m pytest)" if not gpu
            else "not run (--suite runs it)"))
    text = report(in_plan_order(results), head, gpu, steps, tail)
    print()
    print(text, end="")
    if out:
        out.write_text(text)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    if STOP.is_set():
        kept = (f"are in {jsonl}; the same command with --continue runs the rest" if out else
                "were not kept (no --out): give --out, and --continue can run what a cut run "
                "left")
        print(f"gpu_check: interrupted ({signal.Signals(CAUGHT[0]).name}) after "
              f"{time.monotonic() - t_start:.0f} s: {len(ended)} row(s) of this run ended and "
              f"{kept}", file=sys.stderr)
        return 128 + CAUGHT[0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
