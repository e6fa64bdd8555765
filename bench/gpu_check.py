"""The GPU acceptance run: one command that fits a short GPU allocation, one markdown table.

    python bench/gpu_check.py --out bench/results/gpu.md          # at most 8 minutes
    python bench/gpu_check.py --out bench/results/gpu.md --continue   # the rows a cut run left
    python bench/gpu_check.py --rows targets --out bench/results/gpu-targets.md  # one lane
    python bench/gpu_check.py --rows compile --minutes 9 --out bench/results/gpu-compile.md
    python bench/gpu_check.py --dry-run                            # the lanes, estimated

What it does: a list of rows, each in its own process with its own timeout, run in lanes. The
timed rows (a training run whose img/s is a figure) run one after another in the first lane;
the untimed rows (the equivalence tests, the shared-GPU tests, the rank-0-of-8 memory rows,
kill-and-resume, the profiled launch counts, the launchers, building the tree) run in the other
lanes beside them, since a peak is per process and a count is a count (--lanes, default 4,
1 with --rows targets; --lanes 1 runs every row alone). A row is started only when the time
left of --minutes is at least its time estimate: the seconds it took in an earlier run (the
JSON lines beside --out, --estimates, or the runs recorded in bench/results/gpu-*.jsonl, the
newest measurement winning), else the plan's guess. Each finished row is appended at once to
a JSON-lines file beside --out with its seconds (and the markdown report rewritten), so a run
cut short keeps every row it finished, and --continue runs only the rows not yet there; run
again without --continue, the earlier rows and report are kept as <name>.before-<time>.

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
  with Inductor's own cache (/tmp/torchinductor_$USER), so a second run on the same node
  compiles from it. By the plan's guesses (150 to 360 s a
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
import contextlib
import datetime
import json
import math
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

from bench.gpu_plan import DATA, WINDOW, Row, plan, row_key, row_steps  # noqa: E402
from bench.gpu_report import in_one_line, report  # noqa: E402
from bench.gpu_rows import Setting, prepare_data, run_row, whole_suite  # noqa: E402
from bench.lanes import CAUGHT, INTERRUPTED, catch_stops, print_plan, run_lanes  # noqa: E402
from bench.process_tree import STOP, TIMED_OUT  # noqa: E402
from training import allocation, faults, flags  # noqa: E402

TITLE = "# GPU acceptance run"  # the first line of every report it writes
CUT = "cut short"  # the words a row the end of --minutes cut starts its note with


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
    out = Path(args.out) if args.out else None
    if out and out.is_dir():
        return f"--out {out} is a folder: give the report a file name, such as {out / 'gpu.md'}"
    if out and out.is_file() and not out.read_bytes().startswith(TITLE.encode()):
        other = out.with_name(out.stem + "-run.md")
        return (f"--out {out} is a report gpu_check did not write (its first line is not "
                f"\"{TITLE} (...)\": edited by hand?), which the run would replace: give "
                f"another --out, such as {other} (to continue its rows, copy "
                f"{jsonl.name} to {other.with_suffix('.jsonl').name} first)")
    if out and out == jsonl:
        return (f"--out {out} would be its own rows file (the rows go to the .jsonl beside "
                f"--out): give the report a .md name, such as {out.with_suffix('.md')}")
    for flag, path in (("--out", out and out.parent), ("--work-dir", args.work_dir)):
        blocked = faults.file_in_the_way(path) if path else None
        if blocked:
            return f"{flag}: {blocked} is a file, not a folder: give a path in a folder"
    return None


RECORDED = Path(__file__).resolve().parent / "results"  # the runs committed, gpu-*.jsonl


def recorded_runs() -> list:
    """The JSON lines of the acceptance runs recorded in bench/results, oldest first (by the
    date in their names): each row's newest measurement is its estimate on a new --out."""
    def date(path: Path) -> str:
        found = re.search(r"\d{4}-\d{2}-\d{2}", path.name)
        return found.group(0) if found else ""
    return sorted(RECORDED.glob("gpu-*.jsonl"), key=lambda p: (date(p), p.name))


def earlier_rows(args, jsonl: Path | None) -> tuple:
    """(the rows of the earlier runs, those of them --continue keeps): the recorded runs', then
    --estimates' and the JSON lines beside --out, a later file's measurement of a row winning;
    a line a cut run left half written is left out, with a notice."""
    earlier, kept = [], []
    for path in [*recorded_runs(), *filter(None, (Path(args.estimates) if args.estimates
                                                  else None, jsonl))]:
        if path.is_file():
            found, broken = read_rows(path)
            earlier += found
            if broken:
                print(f"notice: {path}: {broken} line(s) not a whole row (a run cut while "
                      f"writing, or an edit), left out", flush=True)
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
        if isinstance(row, dict) and isinstance(row.get("label"), str) and all(
                type(row.get(k)) is int for k in ("image", "batch")):
            rows.append(row)
        else:
            broken += 1
    return rows, broken


def finished(row: dict) -> bool:
    """Whether an earlier run's row has its result (passed, failed or not for this device),
    so --continue leaves it; a row "not started", or cut by an interruption or by the end of
    --minutes, runs."""
    return not str(row.get("skipped", "")).startswith(("not started", INTERRUPTED, CUT))


def measured_seconds(rows: list, device: str) -> dict:
    """{(key, steps per epoch): seconds} of the rows an earlier run ran on ``device``: the
    time estimates of the same rows in this run. A row's seconds that are no number of 0 or
    more (a file edited by hand: NaN, a string) are no estimate: the plan's guess stands."""
    return {(row_key(r["label"], r["image"], r["batch"]), r.get("steps_per_epoch")): r["seconds"]
            for r in rows if r.get("device") == device and is_time(r.get("seconds"))
            and type(r.get("steps_per_epoch")) is int
            and "skipped" not in r}  # a cut row's seconds say nothing of the row


def cut_seconds(rows: list, device: str) -> dict:
    """{(key, steps per epoch): seconds} of the rows the end of --minutes cut in an earlier run
    on ``device``: the least each needs, the floor of its time estimate."""
    return {(row_key(r["label"], r["image"], r["batch"]), r.get("steps_per_epoch")):
            r["at_least_s"] for r in rows if r.get("device") == device
            and str(r.get("skipped", "")).startswith(CUT) and is_time(r.get("at_least_s"))}


def is_time(value) -> bool:
    """Whether ``value`` is a time in seconds: a finite number, 0 or more."""
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def main(argv=None) -> int:
    """The run (``acceptance_run``), with the signal handlers it sets put back after it."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return acceptance_run(argv)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def rows_at_once(pending: list, lanes: int) -> int:
    """How many of ``pending`` can run at once in ``lanes``: the timed lane's one, and one in
    each other lane while untimed rows are left for them."""
    timed = any(row.in_timed_lane for row in pending)
    return max(1, min(lanes, int(timed) + sum(not row.in_timed_lane for row in pending)))


@contextlib.contextmanager
def row_threads(at_once: int):
    """While the rows run: each row's processes get their share of the host's cores for
    their intra-op threads (OMP_NUM_THREADS, which every row inherits; one already set is
    kept), ``at_once`` rows sharing them. Left at all the cores, the thread pools of rows run
    side by side spin on the same cores: the fsdp --offload fp16 row, whose optimizer steps
    on the CPU, gave no result within 180 s beside three other lanes, twice, and trained its
    epoch of 30 steps in 17 s alone (H200, 16 cores). Yields what the report says of it."""
    if "OMP_NUM_THREADS" in os.environ:
        yield f"{os.environ['OMP_NUM_THREADS']!r}, as set before the run"
        return
    cores = allocation.usable_cpus()
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // at_once))
    try:
        yield f"{os.environ['OMP_NUM_THREADS']} ({cores} cores, {at_once} row(s) at once)"
    finally:
        del os.environ["OMP_NUM_THREADS"]


@contextlib.contextmanager
def work_folder(given):
    """The run's folder (the generated tree, the cache, the profile): --work-dir's, kept, or a
    new one in the temporary folder, removed however the run ends (an error, a stop)."""
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given)
        return
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
                        "run's time estimates, over those recorded in bench/results/gpu-*.jsonl "
                        "(those beside --out win over both)")
    p.add_argument("--dry-run", action="store_true",
                   help="print which row runs in which lane and when, by the time estimates, "
                        "and run nothing")
    p.add_argument("--data-dir", default=None,
                   help="a TinyImageNet folder (original layout) for the input-path and memory "
                        "rows; default: generate one when such a row is reached")
    p.add_argument("--work-dir", default=None,
                   help="where the generated tree, the cache and the traces go, kept after "
                        "the run (default: a temporary folder, removed when the run ends)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per epoch of each headline row, at most {WINDOW} for "
                        f"the others (default: 100 on a GPU, 3 on the CPU)")
    p.add_argument("--out", default=None,
                   help="write the report (markdown) here, rewritten after every row, and the "
                        "rows as JSON lines beside it (.jsonl), appended as each finishes, and "
                        "the launcher row's logs and timeline in a folder beside it")
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
    if args.lanes is None:  # the target rows alone: no other row beside them on the GPU
        args.lanes = 1 if args.rows == "targets" else 4
    if not 0 < args.minutes < math.inf or (args.steps is not None and args.steps < 1) or \
            args.lanes < 1:
        p.error("--minutes, --steps and --lanes must be numbers above 0")
    out = Path(args.out) if args.out else None
    jsonl = out.with_suffix(".jsonl") if out else None
    wrong = missing_input(args, jsonl)
    if wrong:
        print(f"error: {wrong}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    steps = args.steps or (100 if gpu else 3)
    rows = plan(args.rows, gpu)
    earlier, kept = earlier_rows(args, jsonl)
    seconds = measured_seconds(earlier, device)
    no_time = [r for r in earlier if r.get("seconds") is not None and not is_time(r["seconds"])]
    if no_time:
        print(f"notice: {len(no_time)} earlier row(s) whose seconds are no time (such as "
              f"{no_time[0]['seconds']!r}): the plan's guesses stand for them", flush=True)

    floors = cut_seconds(earlier, device)

    def need(row: Row) -> float:
        key = (row.key, row_steps(row, steps))
        return max(seconds.get(key, row.need_s), floors.get(key, 0.0))

    results, pending = to_run(rows, kept, gpu, args.lanes)
    if args.dry_run:
        measured = sum((row.key, row_steps(row, steps)) in seconds for row in pending)
        print(f"plan: --rows {args.rows}, --minutes {args.minutes:g}; time estimates: "
              f"{measured} measured before (recorded in bench/{RECORDED.name}/ or beside --out), "
              f"the rest the plan's guesses"
              + (f"; {len(kept)} row(s) kept from the earlier run" if kept else "")
              + (f"; {len(results) - len(kept)} row(s) CUDA only, skipped"
                 if len(results) > len(kept) else ""))
        print_plan(pending, args.lanes, 60 * args.minutes, need)
        return 0

    catch_stops()  # from here on, Ctrl-C and SIGTERM end the run with its report written
    if not gpu:
        print("notice: no GPU visible: a small CPU smoke run (ResNet-18, a small tree, "
              f"{steps} steps); the CUDA-only rows and the CUDA equivalence tests are skipped",
              flush=True)
    with work_folder(args.work_dir) as work:
        root = Path(args.data_dir) if args.data_dir else work / "tiny-imagenet-200"
        setting = Setting(gpu=gpu, model="resnet50" if gpu else "resnet18", steps=steps, work=work,
                          paths={"data": str(root), "cache": str(work / "cache"),
                                 "profile": str(work / "profile")},
                          keep=out.with_name(out.stem + "-launcher") if out else None,
                          data_cores=max(1, allocation.usable_cpus()
                                         // rows_at_once(pending, args.lanes)))
        jsonl = jsonl or work / "rows.jsonl"
        cmd = "python bench/gpu_check.py" + "".join(
            f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv))
        with row_threads(rows_at_once(pending, args.lanes)) as threads:
            head = [f"{TITLE} ({setting.model})", ""] + [
                f"- {v}" for v in versions(gpu)] + [f"- command: `{cmd}`",
                                                    f"- OMP_NUM_THREADS of each row: {threads}"] + (
                [f"- continued: {len(kept)} row(s) from the earlier run in {jsonl.name}"]
                if args.continue_run else [])
            run = Run(args, setting, rows, results, head, out, jsonl, need,
                      deadline=t_start + 60 * args.minutes)
            print(f"rows: appended to {run.jsonl} as each finishes; {len(pending)} job(s) in "
                  f"{args.lanes} lane(s)", flush=True)
            run.not_started(run_lanes(pending, args.lanes, run.deadline, need, run.row, run.record))
        return run.finish(time.monotonic() - t_start)  # --suite: with the node's own threads


def to_run(rows: list, kept: list, gpu: bool, lanes: int) -> tuple:
    """(the results so far: the rows --continue kept and the CUDA-only rows skipped on the
    CPU, the rows to run): the data job goes where its first reader needs it (with lanes: at
    once, beside the timed rows; in one lane: just before that row)."""
    done = {row_key(r["label"], r["image"], r["batch"]) for r in kept}
    results, pending = list(kept), []
    for row in rows:
        if row.key in done:
            continue
        if row.cuda_only and not gpu:
            results.append({"label": row.label, "batch": row.batch, "image": row.image,
                            "kind": row.kind, "skipped": "skipped (CUDA only)"})
        else:
            pending.append(row)
    first_data = next((i for i, row in enumerate(pending) if row.needs_data), None)
    if first_data is not None:
        pending.insert(0 if lanes > 1 else first_data,
                       Row(DATA, 0, kind="data", need_s=40 if gpu else 15))
    return results, pending


def set_aside(jsonl: Path, out: Path | None) -> None:
    """An earlier run's rows and report at this --out, run again without --continue: kept
    under names of their own (<name>.before-<time>), not overwritten by the new run's."""
    if not (jsonl.is_file() and jsonl.stat().st_size):
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(jsonl.stat().st_mtime))
    moved = []
    for path in filter(None, (jsonl, out)):
        if path.is_file():
            aside = path.with_name(f"{path.stem}.before-{stamp}{path.suffix}")
            os.replace(path, aside)
            moved.append(str(aside))
    print(f"notice: the earlier run at this --out is kept as {' and '.join(moved)} "
          f"(--continue runs only the rows it did not finish)", flush=True)


class Run:
    """One acceptance run as its rows end: each row's result appended to the JSON lines at once
    (a run cut short keeps it) and the markdown report rewritten; at the end the rows left
    unstarted, the test suite (--suite), the whole report and the exit code."""

    def __init__(self, args, setting: Setting, rows: list, results: list, head: list,
                 out: Path | None, jsonl: Path, need, deadline: float):
        self.args, self.setting, self.head, self.out, self.jsonl = args, setting, head, out, jsonl
        self.need, self.deadline = need, deadline
        self.device = "cuda" if setting.gpu else "cpu"
        self.results = results  # in the order they ended; the report puts them in plan order
        self.order = {row.key: i for i, row in enumerate(rows)}
        self.ended = []  # the rows of this run that ended (not cut by a stop)
        self.lane_seconds = [0.0] * args.lanes
        self.data_notes, self.data_error = [], []
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
        if not args.continue_run:
            set_aside(jsonl, out)
        # the kept rows rewritten whole: a half line a cut run left is gone before any is
        # appended (through a new file: a stop while writing cannot cut the earlier rows short)
        fresh = jsonl.with_name(jsonl.name + ".new")
        fresh.write_text("".join(json.dumps(r) + "\n" for r in results))
        os.replace(fresh, jsonl)

    def row(self, row: Row) -> dict:
        """Runs one job of a lane: the data, or a row (a row that needs the data fails with
        the data's error). A row whose timeout the end of --minutes cut shorter than its own,
        and which reached it, is no failure of the row: it is marked cut (--continue runs it),
        with the seconds it had, the least its next estimate may be."""
        own = max(self.args.row_timeout, 2 * self.need(row))
        timeout = max(10.0, min(own, self.deadline - time.monotonic()))
        if row.kind == "data":
            error = prepare_data(Path(self.setting.paths["data"]), self.setting.paths,
                                 self.setting.gpu, bool(self.args.data_dir), timeout,
                                 self.setting.data_cores)
            return {"error": error} if error else {}
        if row.needs_data and self.data_error:
            return {"error": self.data_error[0]}
        result = run_row(row, self.setting, timeout)
        # its own timeout's note (a row that went on past it by design, a launcher row's
        # analysis, ended with its result, which stands)
        timed_out = any(str(result.get(k, "")).startswith(TIMED_OUT) for k in ("error", "text"))
        if timeout < own and timed_out and not STOP.is_set():
            return {"skipped": f"{CUT} by the end of --minutes {self.args.minutes:g} after "
                               f"{timeout:.0f} s (its estimate: {self.need(row):.0f} s); "
                               f"--continue runs it", "at_least_s": round(timeout)}
        return result

    def record(self, row: Row, result: dict) -> None:
        """A job of a lane ended: its row kept, printed, appended and reported."""
        self.lane_seconds[result["lane"]] += result["seconds"]
        if row.kind == "data":
            note = result.get("error") or result.get("skipped") or "ready"
            self.data_notes.append(f"{row.label}: {note} "
                                   f"({result['seconds']:.0f} s, lane {result['lane']})")
            print(f"  {self.data_notes[-1]}", flush=True)
            self.data_error.extend([result["error"]] if "error" in result else [])
            return
        result = {"label": row.label, "batch": row.batch, "image": row.image,
                  "kind": row.kind, "timed": row.in_timed_lane, "device": self.device,
                  "steps_per_epoch": row_steps(row, self.setting.steps)} | result
        self.results.append(result)
        self.ended.extend([] if "skipped" in result else [row.key])
        with open(self.jsonl, "a") as f:  # written at once, so a run cut short keeps this row
            f.write(json.dumps(result | {"cmd": " ".join(map(str, result.get("cmd", [])))})
                    + "\n")
        print(f"  {row.key}: {in_one_line(result)} ({result['seconds']:.0f} s, lane "
              f"{result['lane']})", flush=True)
        if self.out:
            self.out.write_text(self.report([]))

    def report(self, tail: list) -> str:
        """The markdown report of the rows so far, in the plan's order."""
        found = sorted(self.results, key=lambda r: self.order.get(
            row_key(r["label"], r["image"], r["batch"]), len(self.order)))
        return report(found, self.head, self.setting.gpu, self.setting.steps, tail)

    def not_started(self, left: list) -> None:
        """The rows the lanes did not start, listed with why (appended too: --continue runs
        them)."""
        minutes = self.args.minutes
        unstarted = [{"label": row.label, "batch": row.batch, "image": row.image,
                      "kind": row.kind, "skipped": "not started: the run was interrupted"
                      if STOP.is_set() else f"not started: --minutes {minutes:g} had no "
                      f"{self.need(row):.0f} s left for it"}
                     for row in left if row.kind != "data"]
        self.results += unstarted
        with open(self.jsonl, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in unstarted)

    def finish(self, seconds: float) -> int:
        """The test suite (--suite), the whole report printed and written, the exit code."""
        args, gpu = self.args, self.setting.gpu
        failed = any("error" in r for r in self.results)
        tail = ["", f"rows: {seconds:.0f} s of --minutes {args.minutes:g}, {args.lanes} "
                    f"lane(s) busy " + ", ".join(f"{s:.0f}" for s in self.lane_seconds) + " s"]
        tail += self.data_notes
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
        text = self.report(tail)
        print()
        print(text, end="")
        if self.out:
            self.out.write_text(text)
        if STOP.is_set():
            kept = (f"are in {self.jsonl}; the same command with --continue runs the rest"
                    if self.out else "were not kept (no --out): give --out, and --continue "
                    "can run what a cut run left")
            print(f"gpu_check: interrupted ({signal.Signals(CAUGHT[0]).name}) after "
                  f"{seconds:.0f} s: {len(self.ended)} row(s) of this run ended and {kept}",
                  file=sys.stderr)
            return 128 + CAUGHT[0]
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
