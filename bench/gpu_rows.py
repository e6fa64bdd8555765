"""How each kind of row of the GPU acceptance run runs (bench/gpu_check.py starts them): a
training run and the figures of its [METRIC], [MEMORY] and [PROFILE] lines, the raw step, the
equivalence tests, kill-and-resume, --save-model, the launchers, and the data the input-path
rows read. Each row is a process of its own with a timeout; each returns its result as a dict
(its figures, or "error": why it failed), which the report reads."""

from __future__ import annotations

import datetime
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import raw_step
from bench.gpu_plan import Row, raw_args, row_args, row_steps
from bench.process_tree import (FAULTHANDLER, STOP, RowTimeout, end_tree, exited, fatal_stack,
                                run_command)
from training import contract, models
# tests/ is on the path: gpu_check puts it there, as pytest does
from make_tinyimagenet import make_tree, make_tree_parallel

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Setting:
    """What every row of one acceptance run shares."""
    gpu: bool
    model: str  # ResNet-50 on a GPU, ResNet-18 on the CPU
    steps: int  # training steps per epoch of a headline row
    work: Path  # the generated tree, the cache, the traces, the rows' checkpoints
    paths: dict  # data, cache, profile: the folders a training row's command line names
    keep: Path | None  # where the launcher row's logs and timeline are kept (beside --out)
    data_cores: int = 0  # the data job's writers and decoders: its share of the cores (0: all)


def run_row(row: Row, setting: Setting, timeout: float) -> dict:
    """The row run as its kind says, in processes of its own: its result."""
    steps = row_steps(row, setting.steps)
    if row.kind in ("tests", "shared tests"):
        passed, text, fatal = equivalence_tests(torch.cuda.device_count(), timeout,
                                                shared=row.kind == "shared tests")
        return dict(passed=passed, text=text, fatal=fatal) | (
            {"error": "see below"} if passed is False else {})
    if row.kind == "kill-resume":
        return run_kill_resume(row, setting.work, setting.gpu, timeout)
    if row.kind == "save-model":
        return run_save_model(row, setting.work, setting.gpu, timeout)
    if row.kind == "raw":
        return run_raw(row, raw_args(row, setting.model, steps, setting.gpu), timeout)
    if row.kind == "launcher":
        return run_launcher(row, setting.model, steps, setting.work, setting.keep, timeout)
    return run_training(row, row_args(row, setting.model, steps, setting.paths), timeout)


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


def run_training(row: Row, args: list, timeout: float) -> dict:
    """One training run: the second epoch's [METRIC] figures, how much longer the first epoch
    took (its warm-up) and the [MEMORY] prediction; a "profile" row: the [PROFILE] step
    breakdown and launches per step; a "held" row (--simulate-world-size): the [MEMORY]
    prediction and the [MEMORY-HELD] figures; or the reason it failed."""
    cmd = [sys.executable, str(REPO / row.script), *args]
    env = None
    if "--compile" in args:
        # torch logs each recompilation, to count those inside the timed epoch. Inductor's
        # cache (torch's default: /tmp/torchinductor_$USER) outlives the run, so the next run
        # of the row on this node compiles from it
        env = dict(os.environ, TORCH_LOGS="recompiles")
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
    test failed, not only how many, and where a crashed rank was. At the timeout every process
    of the tests ends, the training runs they started included (a rank left behind kept the
    GPU busy beside the next rows), and the stack is where the runs were."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = run_command(cmd, timeout, env)
    except RowTimeout as late:
        return False, str(late), [], late.stack
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
    summarize = [sys.executable, str(REPO / "analyze_memory.py"), "--plot", str(run_dir)]
    try:  # a timeout gives the row's "timed out" result, which --continue runs again
        summary = run_command(summarize, left)
    except RowTimeout as late:
        return late.result(summarize)
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


CACHE_BUILD_S = 60.0  # the least time the data row's cache build gets (44 s on the H200)


def prepare_data(root: Path, paths: dict, gpu: bool, given: bool, timeout: float,
                 cores: int = 0) -> str | None:
    """The TinyImageNet tree (unless given) and its uint8 cache, once, outside any timed row;
    an error's text, or None. A cache build that outlives ``timeout`` is ended (its lane
    waited for ever, and the run with it). It writes and decodes with ``cores`` processes,
    its row's share of the host (0: every core): with all of them, its 16 writers ran beside
    the first timed rows of the other lanes, whose eager figures are the host's."""
    t0 = time.monotonic()
    if not given and not (root / "wnids.txt").is_file():
        if gpu:
            make_tree_parallel(root, 200, 500, 50, workers=cores)
        else:
            make_tree(root, classes=4, train_per_class=40, val_per_class=10)
        print(f"data: generated {root} in {time.monotonic() - t0:.0f} s", flush=True)
    try:  # at least CACHE_BUILD_S: a tree generated slowly left the build none
        built = run_command([sys.executable, str(REPO / "ddp_train.py"), "--data-dir", str(root),
                             "--data-cache", paths["cache"], "--check"]
                            + (["--num-workers", str(cores)] if cores else []),
                            max(CACHE_BUILD_S, timeout - (time.monotonic() - t0)))
    except RowTimeout as late:
        return f"building the cache: {late}"
    if built.returncode != 0:
        last = (built.stderr.strip() or "no output").splitlines()[-1]
        return f"building the cache failed: {last[:200]}"
    print(f"data: cache ready in {paths['cache']} ({time.monotonic() - t0:.0f} s)", flush=True)
    return None
