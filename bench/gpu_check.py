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
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from bench import raw_step  # noqa: E402
from training import contract, flags, hangs, models, simulate  # noqa: E402
from make_tinyimagenet import make_tree, make_tree_parallel  # noqa: E402

CEILING = "ddp, synthetic on device"
GRAPH = "ddp --cuda-graph, synthetic on device"
FSDP = "fsdp full, synthetic on device"
RAW_EAGER = "raw step, eager"  # bench/raw_step.py: the plain step, nothing of the toolkit
RAW_GRAPH = "raw step, whole-step CUDA graph"
WINDOW = 30  # steps an epoch of a row whose figure is no headline: enough for a steady rate
# a guess at each --compile mode's row until one is measured (ResNet-50, a cold cache)
COMPILE_GUESS = {"default": 150, "reduce-overhead": 180, "max-autotune-no-cudagraphs": 300,
                 "max-autotune": 360}
DATA = "data: the TinyImageNet tree and its uint8 cache"  # a job for a lane, not a table row


@dataclass
class Row:
    label: str
    batch: int
    script: str = "ddp_train.py"
    args: list = field(default_factory=list)
    image: int = 64
    cuda_only: bool = False
    needs_data: bool = False  # the TinyImageNet tree and its cache
    need_s: int = 45  # the plan's guess of what it takes on one GPU, before a run measured it
    kind: str = "train"  # or "raw" (bench/raw_step.py), "held" (--simulate-world-size),
    # "profile", "tests", "shared tests", "launcher", "kill-resume", "save-model", "data"
    headline: bool = False  # a target's figure: --steps steps an epoch, not WINDOW
    timed: bool = True  # a training row whose img/s is a figure (--rows memory: the peak is)

    @property
    def key(self) -> str:
        return row_key(self.label, self.image, self.batch)

    @property
    def in_timed_lane(self) -> bool:
        """Whether the row runs in the timed lane, where no other timed row runs beside it."""
        return self.kind in ("train", "raw") and self.timed


def row_key(label: str, image: int, batch: int) -> str:
    """What names one row across runs (a JSON line has the three fields)."""
    return f"{label}, {image} px, batch {batch}"


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
    """The rows of ``which`` (speed, targets, memory, compile, all): the timed rows in the
    order they run, then the untimed ones in the order the lanes take them (the longest
    first)."""
    small, big, huge = (256, 1024, 2048) if gpu else (8, 16, 32)
    side = 224 if gpu else 96  # the seed's setting (the CPU smoke run: smaller)
    synth, graph, profile = ["--data-on-device"], ["--cuda-graph"], ["--profile", "{profile}"]
    wide = ["--image-size", str(side)]
    full = ["--sharding", "full"]
    one_gpu = ["--gpus", "1"] if gpu else []
    # need_s: the plan's guess until a run has measured the row. On the first H200 runs a
    # training row of 100 steps took 21 s (64 px, batch 256) to 74 s (224 px), most of it the
    # process's start and the synthetic data made on the host; the rest is guessed from those
    timed = [
        Row(CEILING, small, args=synth, headline=True, need_s=25),
        Row(GRAPH, small, args=synth + graph, cuda_only=True, headline=True, need_s=25),
        Row(CEILING, big, args=synth, headline=True, need_s=35),
        Row(GRAPH, big, args=synth + graph, cuda_only=True, headline=True, need_s=35),
        Row("ddp fp16 (fused SGD), synthetic on device", small,
            args=synth + ["--amp", "fp16"], cuda_only=True, headline=True, need_s=25),
        # 224 px: what the seed trains on (on the CPU too slow to tell anything)
        Row(CEILING, small, args=synth + wide, image=side, cuda_only=True, headline=True,
            need_s=75),
        Row(GRAPH, small, args=synth + wide + graph, image=side, cuda_only=True, headline=True,
            need_s=75),
        Row(FSDP, small, "fsdp_train.py", synth + wide + full, image=side, cuda_only=True,
            headline=True, need_s=80),
        Row(CEILING, huge, args=synth, cuda_only=True, need_s=25),
        Row(FSDP, small, "fsdp_train.py", synth + full, need_s=20),
        Row("dp (one GPU), synthetic on device", small, "dp_train.py", synth + one_gpu,
            need_s=20),
        Row("ddp, cache", small, args=["{data}", "{cache}"], needs_data=True, need_s=20),
        Row("ddp, cache held on device", big, args=["{data}", "{cache}", "--data-on-device"],
            needs_data=True, need_s=20),
        Row("ddp, JPEG folder", small, args=["{data}"], needs_data=True, need_s=25),
    ]
    rungs = [("dp", "dp_train.py", one_gpu), ("ddp", "ddp_train.py", []),
             ("ddp --zero1", "ddp_train.py", ["--zero1"]),
             ("fsdp grad-op", "fsdp_train.py", ["--sharding", "grad-op"]),
             ("fsdp full", "fsdp_train.py", ["--sharding", "full"]),
             ("fsdp full --offload", "fsdp_train.py", ["--offload"])]
    # one GPU as rank 0 of 8 (--simulate-world-size): what each ZeRO rung leaves on a GPU of 8.
    # The CPU smoke run holds them at 64 px only: a CPU's figures are the states, which are the
    # same at every image size, so a second size would only repeat the first.
    at_8 = [Row(f"memory at 8 GPUs: {label}", small, script, synth + extra + (
                [] if px == 64 else ["--image-size", str(px)]) + ["--simulate-world-size", "8"],
                image=px, kind="held", need_s=20 if px == 64 else 30)
            for px in ((64, side) if gpu else (64,)) for label, script, extra in rungs[1:]]
    untimed = [
        Row("equivalence tests, 2 ranks sharing a GPU", 0, kind="shared tests", cuda_only=True,
            need_s=240),
        Row("equivalence tests on CUDA", 0, kind="tests", cuda_only=True, need_s=150),
        Row("kill and resume: fsdp_train.py, 2 ranks sharing the GPU", 16, "fsdp_train.py",
            kind="kill-resume", need_s=60),
        # the case the shared-GPU equivalence tests add to a plain shared-GPU run (the full
        # state dict gathered over gloo from CUDA shards), alone: it ended in SIGSEGV in them
        Row("fsdp --save-model, 2 ranks sharing the GPU", 16, "fsdp_train.py",
            kind="save-model", cuda_only=True, need_s=40),
        Row("launchers: local.sh, its memory logs, analyze_memory.py --plot", small,
            kind="launcher", need_s=60),
        # offload's gradient shards on the CPU under fp16's GradScaler: gloo beside NCCL (what
        # the row shows is that it trains)
        Row("fsdp --offload fp16, synthetic on device", small, "fsdp_train.py",
            synth + ["--offload", "--amp", "fp16"], cuda_only=True, timed=False, need_s=25),
        # the launches per step and where a step's time goes, in rows of their own: the
        # profiler's trace slows the steps around it, so no timed row runs under it
        Row(f"profile: {CEILING}", small, args=synth + profile, kind="profile", need_s=20),
        Row(f"profile: {GRAPH}", small, args=synth + graph + profile, kind="profile",
            cuda_only=True, need_s=25),
        # where FSDP's step loses to DDP's on one GPU (the [PROFILE] breakdown)
        Row(f"profile: {FSDP}", small, "fsdp_train.py", synth + wide + full + profile,
            image=side, kind="profile", cuda_only=True, need_s=40),
    ] + at_8
    memory = [Row(f"memory: {label}", small, script, ["{data}", "{cache}"] + extra
                  + ([] if px == 64 else ["--image-size", str(px)]), image=px, needs_data=True,
                  timed=False, need_s=25 if px == 64 else 40)
              for px in (64, side) for label, script, extra in rungs]
    # eager, --cuda-graph and each --compile mode where they are compared, one after another
    # (a compilation beside a timed row would slow it, and max-autotune times kernels itself):
    # 224 px first, the size the target judges, so that a run its --minutes cut short has
    # those, and --continue the rest
    sizes = [(small, side, wide), (big, 64, [])]
    compiled = [row for batch, px, extra in sizes for row in [
        Row(label, batch, args=synth + extra + more, image=px, cuda_only=True, headline=True,
            need_s=35 if px == 64 else 75) for label, more in ((CEILING, []), (GRAPH, graph))] + [
        Row(compiled_label(mode), batch, args=synth + extra + ["--compile", mode], image=px,
            cuda_only=True, headline=True, need_s=COMPILE_GUESS[mode])
        for mode in flags.COMPILE_MODES]]
    # the plain step without the toolkit, the yardstick of the two rows before it: in the
    # groups that judge the targets (--rows speed, which must fit its 8 minutes, leaves it out)
    raw = [Row(RAW_EAGER, small, "bench/raw_step.py", ["--mode", "eager"], kind="raw",
               headline=True, need_s=15),
           Row(RAW_GRAPH, small, "bench/raw_step.py", ["--mode", "graph"], kind="raw",
               cuda_only=True, headline=True, need_s=15)]
    # --rows targets: the headline rows, those targets() reads and the raw eager step beside
    # them, for figures no other row disturbs
    headline = [row for row in timed if row.headline]
    rows = {"speed": timed + untimed, "targets": headline[:2] + raw + headline[2:],
            "memory": memory, "compile": compiled,
            "all": timed[:2] + raw + timed[2:] + compiled + untimed + memory}[which]
    once = {}  # "all": the eager and --cuda-graph rows of both groups run once
    for row in rows:
        once.setdefault(row.key, row)
    return list(once.values())


def compiled_label(mode: str) -> str:
    return f"ddp --compile {mode}, synthetic on device"


def row_steps(row: Row, steps: int) -> int:
    """Steps an epoch of ``row``: --steps for a headline figure, at most WINDOW for the rest."""
    return steps if row.headline else min(steps, WINDOW)


def synthetic_size(row: Row, steps: int) -> int:
    """Training samples a synthetic row needs: one epoch's batches; rank 0 of N
    (--simulate-world-size) reads 1/N of them and trains simulate.STEPS steps, so N times
    those."""
    if "--simulate-world-size" in row.args:
        world = int(row.args[row.args.index("--simulate-world-size") + 1])
        return row.batch * simulate.STEPS * world
    return row.batch * max(steps, 2)


def row_args(row: Row, model: str, steps: int, paths: dict) -> list:
    """The training script's arguments: two epochs of ``steps`` steps (a profiled row: one,
    its trace window is in the first); synthetic data sized by synthetic_size."""
    args = []
    for a in row.args:
        if a == "{data}":
            args += ["--data-dir", paths["data"]]
        elif a == "{cache}":
            args += ["--data-cache", paths["cache"]]
        elif a == "{profile}":  # a folder of each row's own: rows run side by side
            args.append(str(Path(paths["profile"]) / re.sub(r"\W+", "-", row.key)))
        else:
            args.append(a)
    if not row.needs_data:
        args += ["--synthetic-size", str(synthetic_size(row, steps))]
    epochs = "1" if row.kind == "profile" else "2"
    return ["--model", model, "--epochs", epochs, "--max-steps-per-epoch", str(steps),
            "--batch-size", str(row.batch), "--log-every", "0"] + args


def raw_args(row: Row, model: str, steps: int, gpu: bool) -> list:
    """bench/raw_step.py's arguments: ``steps`` timed steps of the row's mode and size, after
    its 10 warm-up steps on a GPU (cuDNN's autotuning); on the CPU (the smoke run) one."""
    return [*row.args, "--model", model, "--image-size", str(row.image), "--batch-size",
            str(row.batch), "--steps", str(steps)] + ([] if gpu else ["--warmup", "1"])


class RowTimeout(Exception):
    """A row's processes outlived its timeout: the last line it printed, and where each of
    its training processes was (``stack``: the lines of the row's note)."""

    def __init__(self, timeout: float, last_line: str, stack: list):
        said = f" (its last line: {last_line[:150]})" if last_line else ""
        super().__init__(f"no result within {timeout:.0f} s{said}")
        self.stack = stack

    def result(self, cmd: list) -> dict:
        return {"error": str(self), "stack": self.stack, "cmd": cmd}


def run_command(cmd: list, timeout: float, env: dict | None = None
                ) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) in the repository, but at the
    timeout each training process of the row first prints its Python stacks
    (hangs.STACKS_SIGNAL), then every process of the row is ended (end_tree), torchrun's
    workers and the loggers included, and RowTimeout says where the row was: a row that gave
    no result says what it waited for."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hangs.ask_for_stacks([proc.pid] + descendants(proc.pid))
        end_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired as still:  # a process outside the tree holds a pipe:
            # what the row printed until now (bytes, whatever the text mode)
            out, err = (part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                        for part in (still.stdout, still.stderr))
        text = err + "\n" + out  # launch/local.sh's training prints everything to stdout
        printed = [line.strip() for line in out.splitlines()
                   if line.strip() and not is_dump_line(line)]
        raise RowTimeout(timeout, printed[-1] if printed else "",
                         stacks_at_timeout(text)) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def end_tree(root: int) -> list:
    """SIGKILL ``root`` and every process below it, none escaping: each is stopped first
    (SIGSTOP; a stopped process forks no more and its children stay its own) until no new one
    appears, then all are killed. Returns their pids."""
    stopped = []
    for _ in range(100):
        new = [pid for pid in [root] + descendants(root) if pid not in stopped]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            stopped.append(pid)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stopped


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (dead, its parent not told yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


#: A frame line of faulthandler's dump (a traceback's has ", in" and a source line after it)
DUMP_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)$')
DUMP_HEAD = "(most recent call first):"  # a thread's stack begins after such a line
STACK_FRAMES = 4  # innermost frames of each process's main thread kept, and as many of ours


def is_dump_line(line: str) -> bool:
    """Whether ``line`` belongs to a faulthandler dump (a header, a frame, its "..." cut)."""
    return (line.rstrip().endswith(DUMP_HEAD) or bool(DUMP_FRAME.match(line))
            or line.strip() == "...")


def stacks_at_timeout(text: str, processes: int = 3) -> list:
    """Where the main thread of each process that printed its stacks (faulthandler's dump
    in ``text``) was: its innermost frames, then its innermost frames in the toolkit (the line
    of ours that called them), for at most ``processes`` processes, the training processes
    before their DataLoader workers. A main thread is one whose outermost frame is a script's
    <module> (runpy's, run with -m), or whose stack faulthandler cut at 100 frames ("...")."""
    blocks, frames = [], None
    for line in text.splitlines() + [DUMP_HEAD]:
        if frames is not None and DUMP_FRAME.match(line):
            frames.append(line.strip())
            continue
        cut = frames is not None and line.strip() == "..."
        if frames and (cut or frames[-1].endswith((" in <module>", " in _run_module_as_main"))):
            blocks.append(frames + ["..."] * cut)
        frames = [] if line.rstrip().endswith(DUMP_HEAD) else None
    blocks.sort(key=lambda frames: any(f.endswith(" in _worker_loop") for f in frames))
    lines = []
    for number, frames in enumerate(blocks[:processes], 1):
        ours = [f for f in frames[STACK_FRAMES:]
                if f'File "{REPO}/' in f and "-packages/" not in f][:STACK_FRAMES]
        lines += ([f"process {number} of {len(blocks)}, innermost first:"]
                  + [f"  {f[:300]}" for f in frames[:STACK_FRAMES]]
                  + (["  ..."] if len(frames) > STACK_FRAMES + len(ours) else [])
                  + [f"  {f[:300]}" for f in ours])
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


# A crash (SIGSEGV) prints every thread's Python stack: the rows that start ranks set this
FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}
FATAL_LINES = 15  # of the first such stack, kept in the row's note


def fatal_stack(text: str, limit: int = FATAL_LINES) -> list:
    """The first "Fatal Python error" of ``text`` and the stack of the thread that crashed
    (faulthandler's "Current thread", else the first one it printed), at most ``limit``
    lines; [] when nothing crashed."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
    if start is None:
        return []
    after = lines[start + 1:]
    current = next((i for i, line in enumerate(after) if "Current thread" in line), None)
    if current is None:
        current = next((i for i, line in enumerate(after) if "(most recent call first)" in line),
                       len(after))
    stack = after[current:current + 1]
    for line in after[current + 1:]:
        if 'File "' not in line or len(stack) == limit - 1:  # the stack's frames, no more
            break
        stack.append(line)
    return [lines[start].strip()[:300]] + [line.rstrip()[:300] for line in stack]


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


def descendants(pid: int) -> list:
    """The processes below ``pid`` (Linux /proc): a row's script, torchrun and its workers (in
    sessions of their own), launch/local.sh's loggers."""
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
    while not list(ckpt.glob("ckpt-*")) and first.poll() is None and \
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


# ---------------------------------------------------------------------------------------------
# Lanes: which row runs when
# ---------------------------------------------------------------------------------------------

def _pick(pending: list, lane: int, lanes: int, left: float, need, data: str,
          timed_busy: float = 0.0):
    """The row a free ``lane`` starts next: the first of ``pending`` it takes whose estimate
    (``need(row)``, seconds) fits the ``left`` seconds and whose data is there. "wait" when
    such a row waits for the data being built (``data``: "pending", "running", "done" or
    "failed"); None when nothing is left for this lane. One lane takes every row in order; of
    several, the first takes the timed rows, then helps with the others, and the rest take
    the untimed rows; once those are done, where the timed lane (``timed_busy``: the seconds
    its running row still needs) cannot reach its last rows in time, another lane takes the
    last of them that is no headline, beside it, rather than leave it not started."""
    def first(rows):
        waits = False
        for row in rows:
            if need(row) > left:
                continue
            if row.needs_data and data in ("pending", "running"):
                waits = waits or data == "running"
                continue
            return row
        return "wait" if waits else None

    if lanes == 1:
        return first(pending)
    timed = [r for r in pending if r.in_timed_lane]
    untimed = first([r for r in pending if not r.in_timed_lane])
    if lane == 0:
        return first(timed) or untimed
    if untimed is None and timed_busy + sum(map(need, timed)) > left:
        return first([r for r in reversed(timed) if not r.headline][:1])
    return untimed


def run_lanes(pending: list, lanes: int, deadline: float, need, run_row, record) -> list:
    """Run the ``pending`` rows in ``lanes`` threads, each row as ``run_row(row)`` -> its
    result, then ``record(row, result)``, one at a time, with the result's lane, seconds
    and "beside": the keys of the rows that ran at any time during it. A row starts only
    while its estimate fits before ``deadline`` (time.monotonic()). Returns the rows never
    started."""
    pending = list(pending)
    cond = threading.Condition()
    state = {"data": "pending" if any(r.kind == "data" for r in pending) else "done",
             "timed_end": 0.0}  # when the timed lane's running row ends, by its estimate
    running = {}  # key: the keys of the rows that ran beside it so far

    def lane_loop(lane: int) -> None:
        while not STOP.is_set():
            with cond:
                row = "wait"
                while row == "wait" and not STOP.is_set():  # a row waits for the data
                    now = time.monotonic()
                    row = _pick(pending, lane, lanes, deadline - now, need, state["data"],
                                max(0.0, state["timed_end"] - now))
                    if row == "wait":
                        cond.wait(timeout=1.0)
                if row in (None, "wait"):
                    return
                pending.remove(row)
                if row.kind == "data":
                    state["data"] = "running"
                if lane == 0:
                    state["timed_end"] = time.monotonic() + need(row)
                for beside in running.values():
                    beside.add(row.key)
                running[row.key] = set(running)
            t0 = time.monotonic()
            try:
                result = run_row(row)
            except Exception as exc:  # one row's bug: that row fails, the other lanes go on
                traceback.print_exc()
                result = {"error": f"{type(exc).__name__} in gpu_check: {exc}"}
            if STOP.is_set():  # cut: its figure (or failure) is the interruption's
                result = {"skipped": f"{INTERRUPTED} after {time.monotonic() - t0:.0f} s: "
                                     f"--continue runs it again"}
            with cond:
                result.update(lane=lane, seconds=round(time.monotonic() - t0, 1),
                              beside=sorted(running.pop(row.key)))
                if row.kind == "data":
                    state["data"] = "failed" if "error" in result else "done"
                record(row, result)
                cond.notify_all()

    threads = [threading.Thread(target=lane_loop, args=(lane,), name=f"lane {lane}")
               for lane in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return pending


def simulate_lanes(pending: list, lanes: int, budget: float, need) -> tuple:
    """What run_lanes does if every row takes its estimate: ([(lane, row, start, end)], the
    rows never started), seconds from the start."""
    pending, free, ended, runs = list(pending), [0.0] * lanes, set(), []
    data, data_end = ("pending" if any(r.kind == "data" for r in pending) else "done"), 0.0
    while len(ended) < lanes:
        lane = min(set(range(lanes)) - ended, key=lambda n: (free[n], n))
        now = free[lane]
        row = _pick(pending, lane, lanes, budget - now, need,
                    "done" if data == "running" and now >= data_end else data,
                    max(0.0, free[0] - now))
        if row == "wait":
            free[lane] = data_end
        elif row is None:
            ended.add(lane)
        else:
            pending.remove(row)
            free[lane] = now + need(row)
            if row.kind == "data":
                data, data_end = "running", free[lane]
            runs.append((lane, row, now, free[lane]))
    return runs, pending


def print_plan(pending: list, lanes: int, budget: float, need) -> None:
    """--dry-run: each lane's rows, when each starts and ends by its estimate, and the rows
    that would not start."""
    runs, left = simulate_lanes(pending, lanes, budget, need)
    for lane in range(lanes):
        mine = [(row, start, end) for n, row, start, end in runs if n == lane]
        print(f"lane {lane}{' (timed)' if lane == 0 and lanes > 1 else ''}: {len(mine)} "
              f"job(s), ends at about {max((end for *_, end in mine), default=0):.0f} s")
        for row, start, end in mine:
            print(f"  {start:5.0f} - {end:5.0f} s  {row.key}")
    for row in left:
        print(f"not started: {row.key} (about {need(row):.0f} s)")


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


#: Set by Ctrl-C or SIGTERM: no row starts after it; a row that ends after it was cut.
STOP = threading.Event()
CAUGHT: list = []  # the signals that came, the first of which set it
MAIN_PID = os.getpid()
INTERRUPTED = "interrupted"  # the word a cut row's note starts with (--continue runs it)


def stop_rows(signum, frame) -> None:
    """Ctrl-C or SIGTERM: start no more rows and end the running ones (a terminal's Ctrl-C
    reaches them too; a kill of this process alone would not), so the lanes end at once; a
    second signal kills what the first did not end."""
    if os.getpid() != MAIN_PID:  # a forked child (the tree's worker pool) inherited this
        os._exit(128 + signum)
    CAUGHT.append(signum)
    STOP.set()
    for pid in descendants(MAIN_PID):
        try:
            os.kill(pid, signal.SIGTERM if len(CAUGHT) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass


def catch_stops() -> None:
    """stop_rows for SIGINT and SIGTERM, from the start of the run (a SIGINT that the shell
    ignores, as bash does for a script's background job, stays ignored)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop_rows)


def measured_seconds(rows: list, device: str) -> dict:
    """{(key, steps per epoch): seconds} of the rows an earlier run ran on ``device``: the
    time estimates of the same rows in this run."""
    return {(row_key(r["label"], r["image"], r["batch"]), r.get("steps_per_epoch")): r["seconds"]
            for r in rows if r.get("device") == device and r.get("seconds") is not None
            and "skipped" not in r}  # a cut row's seconds say nothing of the row


def targets(results: list) -> list:
    """Issue 39's and 48's targets where their rows ran: (what, met, the figures); met is
    None where a target's row is in the results without a figure (failed, not started)."""
    def rows(label, batch, image=64):
        return [r for r in results if r.get("label") == label and r.get("batch") == batch
                and r.get("image") == image]

    def rate(label, batch, image=64):
        found = [r["img_s"] for r in rows(label, batch, image) if "img_s" in r]
        return found[0] if found else None

    checks = []
    graph_256, eager_1024 = rate(GRAPH, 256), rate(CEILING, 1024)
    best_1024 = max(filter(None, (eager_1024, rate(GRAPH, 1024))), default=None)
    if graph_256:
        checks.append(("64 px, batch 256, --cuda-graph >= 35,000 img/s", graph_256 >= 35000,
                       f"{graph_256:,.0f}"))
    raw_graph = rate(RAW_GRAPH, 256)
    if graph_256 and raw_graph:
        checks.append(("64 px, batch 256, --cuda-graph >= 0.97x the raw whole-step graph",
                       graph_256 >= 0.97 * raw_graph,
                       f"{graph_256 / raw_graph:.2f}x: {graph_256:,.0f} against "
                       f"{raw_graph:,.0f} img/s"))
    elif rows(GRAPH, 256) or rows(RAW_GRAPH, 256):  # planned, and one of them has no figure
        missing = [label for label, figure in ((GRAPH, graph_256), (RAW_GRAPH, raw_graph))
                   if not figure]
        checks.append(("64 px, batch 256, --cuda-graph >= 0.97x the raw whole-step graph",
                       None, f"no figure from: {'; '.join(missing)}"))
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
    ways = [CEILING, GRAPH] + [compiled_label(mode) for mode in flags.COMPILE_MODES]
    at_224 = {way: rate(way, 256, 224) for way in ways if rate(way, 256, 224)}
    if set(at_224) - {CEILING, GRAPH}:  # --rows compile ran
        fastest = max(at_224, key=at_224.get)
        checks.append(("224 px, batch 256: eager, --cuda-graph and every --compile mode "
                       "measured", len(at_224) == len(ways),
                       f"{len(at_224)} of {len(ways)}; the fastest: {fastest}, "
                       f"{at_224[fastest]:,.0f} img/s"))
    return checks


def _figure(value) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def report(results: list, head: list, gpu: bool, steps: int, tail: list) -> str:
    ceiling = {(r["batch"], r["image"]): r["img_s"] for r in results
               if r["label"] == CEILING and "img_s" in r}
    lines = head + ["", "| configuration | image | batch | amp | img/s | ms/step | launches/step "
                        "| peak memory (MiB) | predicted (MiB) | error | vs ceiling "
                        "| warm-up (s) |",
                    "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in results:
        shows_image = r["kind"] in ("train", "raw", "held", "profile")
        where = f"| {r['label']} | {r['image'] if shows_image else ''} | {r['batch'] or ''} |"
        if "img_s" in r:
            key = (r["batch"], r["image"])
            ratio = f"{r['img_s'] / ceiling[key]:.2f}x" if key in ceiling else "n/a"
            predicted, error = "n/a", "n/a"
            if r["predicted"]:
                predicted = f"{r['predicted']:,.0f}"
                error = f"{(r['predicted'] - r['peak']) / r['peak']:+.0%}" if gpu else "n/a"
            warmup = "" if r.get("warmup_s") is None else f"{r['warmup_s']:.1f}"
            lines.append(f"{where} {r['amp']} | {r['img_s']:,.0f} | {r['step_ms']:.1f} | | "
                         f"{r['peak']:,.0f} | {predicted} | {error} | {ratio} | {warmup} |")
            if r.get("beside") and r.get("timed"):
                notes.append(f"{row_key(r['label'], r['image'], r['batch'])}: timed beside "
                             f"{len(r['beside'])} untimed row(s): {'; '.join(r['beside'])}")
        elif "profile" in r:  # --profile: the launches and the step's parts, no timing
            p = r["profile"]
            launches = "" if r["launches"] is None else f"{r['launches']:,.0f}"
            lines.append(f"{where} {r['amp']} | | {_figure(p['step_ms'])} | {launches} "
                         f"| | | | | |")
            notes.append(f"{r['label']}, {r['image']} px, batch {r['batch']}: a traced step "
                         f"of {_figure(p['step_ms'])} ms: compute "
                         f"{_figure(p['compute_ms'])}, exposed communication "
                         f"{_figure(p['exposed_comm_ms'])}, data wait "
                         f"{_figure(p['data_wait_ms'])}, other {_figure(p['other_ms'])} "
                         f"(communication in all {_figure(p['comm_ms'])}; {p['steps']:.0f} "
                         f"steps traced)")
        elif "states" in r:  # --simulate-world-size: memory only
            error = (f"{(r['predicted'] - r['peak']) / r['peak']:+.0%}"
                     if gpu and r["peak"] and r["predicted"] else "n/a")
            peak = f"{r['peak']:,.0f}" if r["peak"] else "n/a"  # on a CPU: none measured
            lines.append(f"{where} {r['amp']} | | | | {peak} | {r['predicted'] or 0:,.0f} | "
                         f"{error} | | |")
            notes.append(f"{r['label']}, {r['image']} px: held params + grads + optimizer + "
                         f"host {r['states']} MiB, predicted {r['predicted_states']}; FSDP "
                         f"units gathered at once: {r['units_in_flight']}")
        elif "skipped" in r:
            lines.append(f"{where} | {r['skipped']} | | | | | | | |")
        elif "error" in r:
            lines.append(f"{where} | FAILED: {r['error']} | | | | | | | |")
        else:
            lines.append(f"{where} | {'passed' if r.get('passed') else 'see below'} "
                         f"| | | | | | | |")
        if "text" in r:
            notes.append(f"{r['label']}: {r['text']}")
        if r.get("fatal"):  # a crashed rank's stack (PYTHONFAULTHANDLER), its first lines
            notes += [f"{r['label']}: where it crashed:"] + [f"    {line}" for line in r["fatal"]]
        if r.get("stack"):  # a row's processes at its timeout (hangs.STACKS_SIGNAL)
            notes += [f"{r['label']}: where it was at the timeout:"] + [
                f"    {line}" for line in r["stack"]]
        if r.get("recompiles_timed") is not None:
            notes.append(f"{r['label']}, {r['image']} px, batch {r['batch']}: "
                         f"{r['recompiles_timed']} recompilation(s) inside the timed epoch "
                         f"(TORCH_LOGS=recompiles)")
        if "summary" in r:
            notes += [f"{r['label']}: timeline.png {'drawn' if r['timeline'] else 'MISSING'}"]
            notes += [f"    {line}" for line in r["summary"]]
    lines += ["", f"each training row: 2 epochs, the second timed (device synchronised at both "
                  f"ends): {steps} steps an epoch where the figure is a target's, "
                  f"{min(steps, WINDOW)} elsewhere; one process" +
              (", one GPU" if gpu else " on the CPU"),
              "launches/step: the host's kernel, copy and graph launches per step, counted by "
              "--profile's trace in a row of its own (5 steps after the warm-up, and after the "
              "capture with --cuda-graph); warm-up: how much longer the first epoch took than "
              "the second (--compile: the compilation)",
              "timed rows run one after another, untimed rows (tests, profiles, memory) in "
              "other lanes beside them; each timed row's note names what ran beside it "
              "(--lanes 1: nothing)"]
    if any(r["kind"] == "raw" for r in results):
        lines.append("raw step: bench/raw_step.py, the plain PyTorch step of the same model "
                     "(no DDP, no loader, no metrics, one static batch on the device): its warm-up "
                     "steps (10 on a GPU), then the timed steps, one process")
    lines += (["error: (predicted - measured) / measured peak, measured as "
               "torch.cuda.max_memory_allocated over the second epoch"] if gpu else
              ["peak memory on the CPU is the process's peak RSS: no prediction to compare "
               "it with (error: n/a)"])
    checks = targets(results) if gpu else []
    if checks:
        verdict = {True: "met", False: "MISSED", None: "not measured"}
        lines += ["", "targets:"] + [f"- {verdict[ok]}: {what} ({figure})"
                                     for what, ok, figure in checks]
        crowded = sum(1 for r in results if r.get("timed") and r.get("beside"))
        if crowded:  # the other lanes share the GPU: a speed figure may be low for that
            lines.append(f"- judged on {crowded} timed row(s) that ran beside other rows on "
                         f"the same GPU (each row's note names them): --lanes 1 times each "
                         f"row alone")
    return "\n".join(lines + [""] + notes + tail) + "\n"


def main(argv=None) -> int:
    """The run (``acceptance_run``), with the signal handlers it sets put back after it."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return acceptance_run(argv)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def acceptance_run(argv=None) -> int:
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
    args = p.parse_args(argv)
    catch_stops()  # from here on, Ctrl-C and SIGTERM end the run with its report written
    if args.lanes is None:  # the target rows alone: no other row beside them on the GPU
        args.lanes = 1 if args.rows == "targets" else 4
    if args.minutes <= 0 or (args.steps is not None and args.steps < 1) or args.lanes < 1:
        p.error("--minutes, --steps and --lanes must be above 0")
    if args.data_dir and not Path(args.data_dir).is_dir():
        print(f"error: --data-dir {args.data_dir} does not exist: point it at a TinyImageNet "
              f"folder, or leave it out to generate one", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    jsonl = out.with_suffix(".jsonl") if out else None
    if args.continue_run and not (jsonl and jsonl.is_file()):
        where = f"at {jsonl}" if jsonl else "without --out"
        print(f"error: --continue reads the rows of an earlier run beside --out, and there are "
              f"none {where}: give the --out of that run, or drop --continue", file=sys.stderr)
        return 2
    if args.estimates and not Path(args.estimates).is_file():
        print(f"error: --estimates {args.estimates} does not exist: give the .jsonl an earlier "
              f"run wrote beside its --out, or leave it out", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    deadline = t_start + 60 * args.minutes
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    steps = args.steps or (100 if gpu else 3)
    model = "resnet50" if gpu else "resnet18"
    rows = plan(args.rows, gpu)

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
        shown = (f"{result['img_s']:,.0f} img/s, {result['step_ms']:.1f} ms/step"
                 if "img_s" in result else f"held {result['states']} MiB (params + grads + "
                 f"optimizer + host), predicted {result['predicted_states']}"
                 if "states" in result else f"{result['launches']} launches per step"
                 if "profile" in result else result.get("error") or result.get("text")
                 or result.get("skipped") or "done")
        print(f"  {row.key}: {shown} ({result['seconds']:.0f} s, lane {result['lane']})",
              flush=True)
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
