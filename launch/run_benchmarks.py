"""Submit a scaling study: strategies x GPUs per node x nodes, one Slurm job and one run directory
each, all under one study directory with a manifest (study.json) of the matrix and the exact
commands. `python collect_results.py STUDY_DIR --plot` then turns it into tables and plots.
docs/slurm.md, "The scaling study", explains the matrix, weak and strong scaling, --resume, --local.

    python launch/run_benchmarks.py --dry-run                      # print the sbatch commands only
    python launch/run_benchmarks.py --strategies ddp fsdp --gpus 1 2 4 8 -- --epochs 3
    python launch/run_benchmarks.py --gpus 1 2 4 8 --nodes 1 2 4 8 --multi-node-gpus 4   # the
                                       # workshop's two tables: 1-8 GPUs on 1 node, 2-8 nodes x 4
    python launch/run_benchmarks.py --scaling strong --global-batch 512 --gpus 1 2 4 8
    python launch/run_benchmarks.py --resume --study-dir runs/study-20250101-120000
    python launch/run_benchmarks.py --local --strategies ddp fsdp --gpus 1 2 --per-gpu-batch 16 \\
        -- --model cnn --synthetic-size 256 --epochs 2 --num-workers 0   # on this machine (CPU ok)

Everything after "--" goes to every run's training script, after the --batch-size that the
scaling mode gives the run; each strategy's script parses it first (launch/check_args.py). A run
is one job of launch/{baseline,multi_gpu,multi_node}.slurm (--local: of launch/local.sh, one
after the other, its output also in STUDY/<name>-<time>.out), named <strategy>-<N>n<G>g, with
--cpus-per-task = G x --cpus-per-gpu and its run directory STUDY/<name>-<job id>/; --dry-run
prints the exact commands.

Environment: what launch/job.sh reads passes through (DATA_DIR, PYTHON, LOG_INTERVAL, ...) and is
recorded in study.json; RUN_DIR, NPROC and NPROC_PER_NODE are dropped: the study sets them per run.
Exit status: 0 all submitted (or, --local, all runs ok); 1 a submission or local run failed;
2 a bad flag or study directory, or a study another run_benchmarks.py is still running (one
sentence naming the fix); 130 interrupted.
"""

from __future__ import annotations

import argparse
import fcntl
import getpass
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

LAUNCH_DIR = Path(__file__).resolve().parent
REPO_DIR = LAUNCH_DIR.parent
sys.path.insert(0, str(REPO_DIR))

import collect_results  # noqa: E402  (the study's reader: no torch)
from reporting import scaling  # noqa: E402  (the runs' statuses)
from collect_results import MANIFEST  # noqa: E402
from reporting.scaling import STRATEGIES  # noqa: E402
from training.contract import DEFAULT_BATCH_SIZE  # noqa: E402  (the training scripts' --batch-size)

# Variables the launchers read that change what is measured: recorded with each invocation.
PROVENANCE_ENV = ("DATA_DIR", "PYTHON", "LOG_INTERVAL", "CHECKPOINT_DIR", "OMP_NUM_THREADS",
                  "CUDA_VISIBLE_DEVICES", "SITE_SH", "SRUN_EXTRA_ARGS", "NCCL_DEBUG",
                  "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CHECK_ONLY",
                  "REQUEUE")
# Variables the study sets itself for every run: an exported value would leak into every job.
DROPPED_ENV = ("RUN_DIR", "NPROC", "NPROC_PER_NODE")
SETTING_FLAGS = {  # the settings besides the matrix -> the flag that sets it, for messages
    "scaling": "--scaling", "per_gpu_batch": "--per-gpu-batch", "global_batch": "--global-batch",
    "cpus_per_gpu": "--cpus-per-gpu", "sbatch_args": "--sbatch-args",
    "train_args": "the training arguments after --",
}


class StudyError(Exception):
    """A problem the user can fix: printed as one sentence, exit code 2."""


def _now() -> str:
    return datetime.now().isoformat(timespec="seconds")


def _unique(values: list) -> list:
    return list(dict.fromkeys(values))


# --------------------------------------------------------------------------------------------
# The command line, and the study's settings
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python launch/run_benchmarks.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [-- TRAINING ARGS]")
    m = parser.add_argument_group("the matrix")
    m.add_argument("--strategies", nargs="+", choices=STRATEGIES,
                   help="strategies to run (default: dp ddp fsdp)")
    m.add_argument("--gpus", nargs="+", type=int, metavar="G",
                   help="GPUs per node (default: 1 2 4 8); without GPUs (--local) processes")
    m.add_argument("--nodes", nargs="+", type=int, metavar="N",
                   help="numbers of nodes (default: 1)")
    m.add_argument("--multi-node-gpus", nargs="+", type=int, metavar="G",
                   help="GPUs per node for the runs on more than one node (default: every "
                        "--gpus value); --multi-node-gpus 4 gives the workshop's node table")
    b = parser.add_argument_group("batch and scaling mode")
    b.add_argument("--scaling", choices=("weak", "strong"),
                   help="weak: per-GPU batch fixed (default); strong: global batch fixed")
    b.add_argument("--per-gpu-batch", type=int, metavar="B",
                   help=f"weak scaling: batch size PER GPU, the same in every run (default "
                        f"{DEFAULT_BATCH_SIZE}); the global batch is B x GPUs")
    b.add_argument("--global-batch", type=int, metavar="B",
                   help="strong scaling: the GLOBAL batch, the same in every run; per-GPU "
                        "batch = B / GPUs")
    b.add_argument("--lr-scaling", choices=("none", "linear", "sqrt"),
                   help="passed to every run: scale the learning rate with the global batch "
                        "(linear: the rule of Goyal et al.; add -- --warmup-epochs E for their "
                        "warm-up); default: the training scripts' none")
    r = parser.add_argument_group("where and how")
    r.add_argument("--study-dir", metavar="DIR",
                   help="the study directory: study.json and one run directory per job "
                        "(default: runs/study-<date>-<time>; --resume needs it)")
    r.add_argument("--dry-run", action="store_true",
                   help="print the commands (a shell script) and exit; submits nothing, "
                        "writes nothing")
    r.add_argument("--local", action="store_true",
                   help="run the single-node part of the matrix on this machine through "
                        "launch/local.sh, one run after the other (CPU: gloo processes)")
    r.add_argument("--resume", action="store_true",
                   help="submit only the runs of --study-dir that are missing or failed")
    r.add_argument("--cpus-per-gpu", type=int, metavar="C",
                   help="sbatch --cpus-per-task = C x GPUs per node (default 4, as in the "
                        ".slurm files), so DataLoader workers per GPU stay the same")
    r.add_argument("--sbatch-args", metavar="'ARGS'",
                   help="extra sbatch options for every job, one quoted string, e.g. "
                        "'--partition=gpu --time=00:30:00 --account=proj'; not those the "
                        "study sets (--job-name, --nodes, --gpus-per-node, --cpus-per-task "
                        "or --cpus-per-gpu, --output, --export)")
    return parser


def settings_from(args, train_args: list) -> dict:
    """The study's settings from the command line; None where a flag was not given, so that
    --resume can tell a setting given again from the study's own."""
    try:
        sbatch_args = None if args.sbatch_args is None else shlex.split(args.sbatch_args)
    except ValueError as e:
        raise StudyError(f"--sbatch-args {args.sbatch_args!r}: {e}; quote it as one "
                         f"string, e.g. --sbatch-args '--partition=gpu --time=01:00:00'") from None
    for arg in sbatch_args or []:
        # sbatch takes a long option's unique abbreviation too (--out for --output)
        name = arg.split("=", 1)[0]
        sets = ([long for long in SBATCH_SETS.values() if long.startswith(name)]
                if arg.startswith("--") and len(name) > 3 else
                [SBATCH_SETS[arg[:2]]] if arg[:2] in SBATCH_SETS else [])
        if len(set(sets)) == 1:
            raise StudyError(f"--sbatch-args {arg}: the study sets {sets[0]} for every job "
                             f"itself (sbatch would take yours instead): leave it out; this "
                             f"command's --gpus, --nodes, --cpus-per-gpu and --study-dir set "
                             f"them")
    return {"strategies": args.strategies, "gpus": args.gpus, "nodes": args.nodes,
            "multi_node_gpus": args.multi_node_gpus, "scaling": args.scaling,
            "per_gpu_batch": args.per_gpu_batch, "global_batch": args.global_batch,
            "cpus_per_gpu": args.cpus_per_gpu, "sbatch_args": sbatch_args,
            "train_args": train_args + (["--lr-scaling", args.lr_scaling] if args.lr_scaling
                                        else [])}


# The sbatch options the study sets for every job (long and short forms), which --sbatch-args,
# coming after them, would silently override
# (--cpus-per-gpu beside the study's --cpus-per-task would be a conflict sbatch refuses)
SBATCH_SETS = {name: long for long, short in (
    ("--job-name", "-J"), ("--nodes", "-N"), ("--gpus-per-node", None),
    ("--cpus-per-task", "-c"), ("--cpus-per-gpu", None), ("--output", "-o"),
    ("--export", None)) for name in (long, short) if name}


# The flags the study sets for every run (or that would name one path for all its runs), each
# with the shortest abbreviation argparse takes for it from the training scripts today (a
# shorter one fits other flags too: --ba is --base-batch or --batch-size, and argparse refuses
# it)
STUDY_SETS = {"--batch-size": "--bat", "--checkpoint-dir": "--checkpoint-d", "--gpus": "--gp",
              "--save-model": "--sa"}


def study_flag(arg: str, flags: dict = STUDY_SETS) -> str | None:
    """The flag of ``flags`` ({name: shortest abbreviation}) that ``arg`` names, in full or
    abbreviated, or None."""
    flag = arg.split("=")[0]
    return next((name for name, shortest in flags.items()
                 if name.startswith(flag) and flag.startswith(shortest)), None)


# The training flags whose optional value is a folder (given bare, each run writes in its own
# run directory), each with the shortest abbreviation argparse takes for it
FOLDER_FLAGS = {"--profile": "--p", "--tensorboard": "--tensorboard"}


def run_folder_flag(train_args: list) -> tuple | None:
    """(``--profile DIR`` or ``--tensorboard DIR`` as given in ``train_args``, with = or
    abbreviated too, and the flag's full name), or None; ``--tensorboard off`` names no
    folder."""
    for i, arg in enumerate(train_args):
        name = study_flag(arg, FOLDER_FLAGS)
        if name is None:
            continue
        _flag, eq, value = arg.partition("=")
        if not eq and i + 1 < len(train_args) and not train_args[i + 1].startswith("-"):
            value, arg = train_args[i + 1], f"{arg} {train_args[i + 1]}"
        if value and not (name == "--tensorboard" and value == "off"):
            return arg, name
    return None


def check_train_args(train_args: list) -> None:
    """Refuse what the study sets for every run itself, abbreviated too (argparse takes --bat
    for --batch-size, and the last value wins: the runs would train at another batch than the
    study's tables say)."""
    if len([a for a in train_args if a.split("=")[0].startswith("--lr-s")]) > 1:
        raise StudyError("--lr-scaling is given both before and after the --: keep the one "
                         "before it")
    for arg in train_args:
        flag = study_flag(arg)
        if flag == "--batch-size":
            raise StudyError(f"{arg} after --: the study sets --batch-size for every run; use "
                             f"--per-gpu-batch N (weak scaling) or --scaling strong "
                             f"--global-batch N instead")
        if flag == "--checkpoint-dir":
            raise StudyError(f"{arg} after --: every run would share one checkpoint folder and "
                             f"resume from the others' checkpoints; drop it (each run "
                             f"checkpoints in its own run directory)")
        if flag == "--save-model":
            raise StudyError(f"{arg} after --: every run would write that one file, the last to "
                             f"end replacing the others' model; drop it (export a run's model "
                             f"from its checkpoints: python export_model.py RUN_DIR/checkpoints "
                             f"model.pt)")
        if flag == "--gpus":
            raise StudyError(f"{arg} after --: the study sets the GPUs of every run; use --gpus "
                             f"before the --")
    folder = run_folder_flag(train_args)
    if folder:
        raise StudyError(f"{folder[0]} after --: every run would write into that one folder, "
                         f"their files mixed; give {folder[1]} without a folder (each run "
                         f"writes in its own run directory)")


def fill_defaults(s: dict) -> dict:
    s = dict(s)
    s["strategies"] = _unique(s["strategies"] or list(STRATEGIES))
    s["gpus"] = _unique(s["gpus"] or [1, 2, 4, 8])
    s["nodes"] = _unique(s["nodes"] or [1])
    s["multi_node_gpus"] = _unique(s["multi_node_gpus"] or [])
    s["scaling"] = s["scaling"] or "weak"
    if s["scaling"] == "weak":
        if s["global_batch"] is not None:
            raise StudyError("--global-batch is for --scaling strong; with weak scaling set the "
                             "per-GPU batch with --per-gpu-batch")
        if s["per_gpu_batch"] is None:
            s["per_gpu_batch"] = DEFAULT_BATCH_SIZE
    else:
        if s["per_gpu_batch"] is not None:
            raise StudyError("--per-gpu-batch is for weak scaling; with --scaling strong set the "
                             "global batch with --global-batch (per-GPU batch = global / GPUs)")
        if s["global_batch"] is None:
            raise StudyError("--scaling strong needs --global-batch N: the global batch that "
                             "stays fixed while the GPUs grow")
    s["cpus_per_gpu"] = 4 if s["cpus_per_gpu"] is None else s["cpus_per_gpu"]
    s["sbatch_args"] = s["sbatch_args"] or []
    for flag, values in (("--gpus", s["gpus"]), ("--nodes", s["nodes"]),
                         ("--multi-node-gpus", s["multi_node_gpus"])):
        bad = [v for v in values if v < 1]
        if bad:
            raise StudyError(f"{flag} {bad[0]}: counts must be at least 1")
    for key in ("per_gpu_batch", "global_batch", "cpus_per_gpu"):
        if s[key] is not None and s[key] < 1:
            raise StudyError(f"{SETTING_FLAGS[key]} {s[key]}: must be at least 1")
    check_train_args(s["train_args"])
    return s


def check_train_args_parse(train_args: list, strategies: list) -> None:
    """Every strategy's script accepts the training arguments, as its jobs' launch/job.sh will
    check: a typo or an impossible value stops the study here, once, not in each of its jobs.
    Skipped with a note where this Python cannot import the scripts (a login node without
    torch)."""
    if not train_args:
        return
    python = shlex.split(os.environ.get("PYTHON") or "") or [sys.executable]
    scripts = ",".join(f"{s}_train" for s in strategies)
    try:
        proc = subprocess.run([*python, str(LAUNCH_DIR / "check_args.py"), scripts, *train_args],
                              cwd=REPO_DIR, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        proc = subprocess.CompletedProcess([], 1, "", str(e))
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode == 2 and ": error: " in last:  # the refusal: argparse's or check_flags'
        script = last.split(":")[0]
        fix = f"fix them (python {script} --help lists its flags)"
        if script == "dp_train.py" and "use ddp_train.py or fsdp_train.py" in last:
            # a flag DataParallel cannot serve (flags.refuse_flags), e.g. --share-gpus
            fix = "leave DataParallel out of the study: --strategies ddp fsdp"
        raise StudyError(f"the training arguments after -- are refused ({last}); {fix}")
    if proc.returncode != 0:
        print(f"note: the training arguments after -- were not checked ({last[:200]}); a "
              f"wrong one fails every run", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------------------------

@dataclass
class Planned:
    """One configuration of the matrix and how it is run."""
    name: str
    strategy: str
    nodes: int
    gpus_per_node: int
    scaling: str
    per_gpu_batch: int | None
    global_batch: int | None
    skipped: str = ""
    argv: tuple = ()
    env: tuple = ()      # (KEY, value) pairs set for the command (--local)
    launcher: str = ""

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + shlex.join(self.argv)

    def entry(self) -> dict:
        """Its entry in study.json."""
        return {"name": self.name, "strategy": self.strategy, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "gpus": self.nodes * self.gpus_per_node,
                "scaling": self.scaling, "per_gpu_batch": self.per_gpu_batch,
                "global_batch": self.global_batch, "launcher": self.launcher,
                "command": self.command if not self.skipped else "",
                "skipped": self.skipped, "attempts": []}


def local_gpus() -> int:
    """GPUs this machine offers a local run: CUDA_VISIBLE_DEVICES, else nvidia-smi -L."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def plan(settings: dict, study: Path, local: bool, gpus_here: int) -> list:
    """Every configuration of the matrix, in order (strategy, nodes, GPUs per node), with its
    command or the reason it is skipped."""
    multi = settings["multi_node_gpus"]
    matrix = [(strategy, nodes, g) for strategy in settings["strategies"]
              for nodes in settings["nodes"]
              for g in (multi if nodes > 1 and multi else settings["gpus"])]
    planned = []
    for strategy, nodes, g in matrix:
        gpus = nodes * g
        if settings["scaling"] == "weak":
            per_gpu, global_batch = settings["per_gpu_batch"], settings["per_gpu_batch"] * gpus
        else:
            global_batch = settings["global_batch"]
            per_gpu = global_batch // gpus if global_batch % gpus == 0 else None
        p = Planned(f"{strategy}-{nodes}n{g}g", strategy, nodes, g, settings["scaling"], per_gpu,
                    global_batch)
        planned.append(p)
        if strategy == "dp" and nodes > 1:
            p.skipped = "DataParallel (dp) is one process on one node; use ddp or fsdp across nodes"
        elif per_gpu is None:
            p.skipped = (f"strong scaling: global batch {global_batch} does not divide by {gpus} "
                         f"GPUs; pick a global batch that all GPU counts divide")
        elif local and nodes > 1:
            p.skipped = "--local runs on this one machine; multi-node runs need Slurm"
        elif local and strategy == "dp" and g > 1 and gpus_here < g:
            p.skipped = (f"dp with {g} GPUs needs {g} GPUs on this machine, which has "
                         f"{gpus_here} (DataParallel is one process: on CPU it drives one device)")
        elif local and gpus_here and g > gpus_here:
            p.skipped = f"{g} processes need {g} GPUs; this machine has {gpus_here}"
        if p.skipped:
            continue
        train = ["--batch-size", str(per_gpu), *settings["train_args"]]
        if local:
            p.launcher = "launch/local.sh"
            if strategy == "dp" and gpus_here:
                train = ["--gpus", str(g), *train]  # DataParallel would take every visible GPU
            nproc = [] if strategy == "dp" else ["--nproc-per-node", str(g)]
            p.env = (("STRATEGY", strategy), ("RUNS_DIR", str(study)), ("JOB_NAME", p.name),
                     ("PYTHON", os.environ.get("PYTHON") or sys.executable))
            p.argv = ("bash", str(LAUNCH_DIR / "local.sh"), *nproc, "--", *train)
        else:
            slurm_file = ("multi_node" if nodes > 1 else "multi_gpu" if g > 1
                          else "baseline") + ".slurm"
            p.launcher = f"launch/{slurm_file}"
            p.argv = ("sbatch", "--parsable", f"--job-name={p.name}", f"--nodes={nodes}",
                      f"--gpus-per-node={g}", f"--cpus-per-task={settings['cpus_per_gpu'] * g}",
                      f"--output={study}/%x-%j.out", *settings["sbatch_args"],
                      f"--export=ALL,STRATEGY={strategy},RUNS_DIR={study}",
                      str(LAUNCH_DIR / slurm_file), *train)
    return planned


# --------------------------------------------------------------------------------------------
# The study directory and its manifest
# --------------------------------------------------------------------------------------------

def _show(value) -> str:
    if isinstance(value, list):
        return shlex.join(str(v) for v in value) if value else "(none)"
    return "(none)" if value is None else str(value)


def saved_settings(manifest: dict, path: Path) -> dict:
    """The settings study.json holds, if they have the shape this script writes (an edit by
    hand, a gpus of ["2"], ends in one sentence, not in a traceback where they are used)."""
    s = manifest["settings"]

    def ints(key, may_be_none=False):
        return (s.get(key) is None and may_be_none) or type(s.get(key)) is int

    def listed(key, kind):
        return isinstance(s.get(key), list) and all(type(v) is kind for v in s[key])

    if not (listed("strategies", str) and set(s["strategies"]) <= set(STRATEGIES)
            and all(listed(key, int) and min(s[key], default=1) >= 1
                    for key in ("gpus", "nodes", "multi_node_gpus"))
            and s.get("scaling") in ("weak", "strong") and ints("cpus_per_gpu")
            and ints("per_gpu_batch", True) and ints("global_batch", True)
            and listed("sbatch_args", str) and listed("train_args", str)):
        raise StudyError(f"{path}: not a study manifest (its settings are not those "
                         f"launch/run_benchmarks.py writes); restore it, or start a new study "
                         f"with another --study-dir")
    return s


def merge_resume(given: dict, manifest: dict, path: Path) -> dict:
    """--resume: the study's settings, checked against those given again on the command line.
    Matrix flags pick a part of the study (and may add configurations); the rest must match."""
    saved = saved_settings(manifest, path)
    merged = dict(saved)
    for key in ("strategies", "gpus", "nodes", "multi_node_gpus"):
        if given[key]:
            merged[key] = given[key]
    for key, flag in SETTING_FLAGS.items():
        value = given[key]
        if key == "train_args" and not value:
            continue
        if value is not None and value != saved.get(key):
            raise StudyError(f"this study was made with {flag} {_show(saved.get(key))}, not "
                             f"{_show(value)}: resume it with the same settings (or leave the "
                             f"flag out), or start a new study with another --study-dir")
    return merged


def open_study(args, given: dict, mode: str) -> tuple:
    """(study directory, manifest, settings): a new study, or the one --resume names."""
    if args.resume:
        if not args.study_dir:
            raise StudyError("--resume needs --study-dir: the study directory to resume")
        study_dir = Path(args.study_dir).resolve()
        try:
            manifest = collect_results.read_manifest(study_dir)
        except collect_results.UsageError as e:
            raise StudyError(str(e)) from None
        if manifest is None:
            raise StudyError(f"--resume: no {MANIFEST} in {study_dir}; point --study-dir at a "
                             f"study that launch/run_benchmarks.py made, or start one without "
                             f"--resume")
        if manifest["mode"] != mode:
            raise StudyError(f"{study_dir} is a {manifest['mode']} study; resume it "
                             f"{'with' if manifest['mode'] == 'local' else 'without'} --local")
        settings = fill_defaults(merge_resume(given, manifest, study_dir / MANIFEST))
    else:
        settings = fill_defaults(given)
        study_dir = Path(args.study_dir or f"runs/study-{datetime.now():%Y%m%d-%H%M%S}").resolve()
        if (study_dir / MANIFEST).exists():
            raise StudyError(f"{study_dir} already holds a study ({MANIFEST}); add --resume to "
                             f"run its missing or failed runs, or pick a new --study-dir")
        if study_dir.exists() and not study_dir.is_dir():
            raise StudyError(f"--study-dir {study_dir} is a file; name a directory")
        manifest = {"version": 1, "created": _now(), "mode": mode,
                    "repo": str(REPO_DIR), "settings": settings, "invocations": [], "runs": []}
    if "," in str(study_dir) and mode == "slurm":
        raise StudyError(f"--study-dir {study_dir} contains a comma, which sbatch --export "
                         f"cannot pass; pick a path without commas")
    return study_dir, manifest, settings


LOCK = ".run_benchmarks.lock"  # held by the run_benchmarks.py working on the study


def hold_study(study_dir: Path, dry_run: bool = False):
    """The study's lock, held until this process ends (the open file returned), or None. A
    study another run_benchmarks.py holds (a local study still running its runs) is refused:
    --resume would read its running run as killed and start it a second time; a dry run,
    which only prints, takes no lock and says so. Where the folder is not there yet, may not
    be written, or its file system has no locks (Lustre without flock), there is none."""
    lock_path = study_dir / LOCK
    try:
        lock = open(lock_path, "r" if dry_run else "a+", encoding="utf-8")
    except OSError:
        return None
    try:
        fcntl.flock(lock, (fcntl.LOCK_SH if dry_run else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:  # held by another process
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        if dry_run:
            print(f"note: {study_dir} is in use by launch/run_benchmarks.py ({holder}): its "
                  f"run that is running now shows as partial below", flush=True)
            return None
        raise StudyError(f"{study_dir} is in use by launch/run_benchmarks.py ({holder}), which "
                         f"is still running it; wait for it to end, or stop it (Ctrl-C in its "
                         f"terminal), then --resume") from None
    except OSError as e:  # no locks on this file system: go on without one
        lock.close()
        if not dry_run:
            print(f"note: no lock on {lock_path} ({e.strerror or e}): nothing stops a second "
                  f"run_benchmarks.py on this study while this one runs", flush=True)
        return None
    if dry_run:
        lock.close()
        return None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}, since {_now()}\n")
    lock.flush()
    return lock


def write_manifest(study: Path, manifest: dict) -> None:
    """Atomically, so an interrupted submission never leaves half a manifest."""
    tmp = study / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, study / MANIFEST)


def record_plan(study_dir: Path, manifest: dict, settings: dict, planned: list, resume: bool,
                argv: list) -> dict:
    """Write study.json before anything runs; returns its entries by name."""
    try:
        study_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StudyError(f"cannot create --study-dir {study_dir} ({e.strerror or e}): name a "
                         f"directory you may write to") from None
    if resume:  # the matrix only grows: a resumed part keeps the rest of the study
        for key in ("strategies", "gpus", "nodes", "multi_node_gpus"):
            settings[key] = _unique(manifest["settings"][key] + settings[key])
    manifest["settings"] = settings
    # (setdefault: a study.json edited by hand may have lost the record; it starts again here)
    manifest.setdefault("invocations", []).append(
        {"time": _now(), "command": shlex.join(["python", "launch/run_benchmarks.py", *argv]),
         "env": {k: os.environ[k] for k in PROVENANCE_ENV if k in os.environ}})
    entries = {e["name"]: e for e in manifest["runs"]}
    for p in planned:
        entry = entries.get(p.name)
        if entry is None:
            entries[p.name] = p.entry()
            manifest["runs"].append(entries[p.name])
        elif not p.skipped:
            entry["command"] = p.command
    write_manifest(study_dir, manifest)
    return entries


# --------------------------------------------------------------------------------------------
# --resume: what still needs running
# --------------------------------------------------------------------------------------------

def queued_job_ids() -> set | None:
    """Job ids of this user still in Slurm's queue (pending, running, requeued); None if
    squeue is not there to ask."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "--noheader", "--format=%i",
                              f"--user={getpass.getuser()}"],
                             capture_output=True, text=True, timeout=60)
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]  # squeue: error: ...
        failed = f"exit {out.returncode}: {last}" if out.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        failed = str(e)
    if failed:
        raise StudyError(f"squeue failed ({failed}); retry when the Slurm controller responds, "
                         f"so that queued jobs are not submitted twice")
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def resume_states(study: Path, manifest: dict, names: list) -> dict:
    """{name: (needs running, why)} from the run directories (collect_results' statuses)."""
    try:
        rows = collect_results.read_study(study)
    except collect_results.UsageError as e:
        raise StudyError(str(e)) from None
    entries = {e["name"]: e for e in manifest["runs"]}
    slurm = manifest["mode"] == "slurm"
    queued = queued_job_ids() if slurm else set()
    states = {}
    for name in names:
        ids = [str(a["job_id"]) for a in entries.get(name, {}).get("attempts", [])
               if a.get("job_id")]
        runs_of = [row for row in rows if row["job_name"] == name]
        best = scaling.best(runs_of) if runs_of else None
        if best is not None and best["status"] == scaling.OK:
            states[name] = (False, f"done ({best['run']})")
            continue
        still = [i for i in ids if queued and i in queued]
        if still:
            states[name] = (False, f"job {still[-1]} is still in squeue")
            continue
        why = f"{best['status']}: {best['detail']}" if best else "not run yet"
        if slurm and ids and queued is None:
            why += f"; squeue not found, so whether job {ids[-1]} is still queued is unknown"
        states[name] = (True, why)
    return states


def select(planned: list, states: dict | None) -> tuple:
    """(runs to start, the lines that say so): commands, and # comments for the rest."""
    todo, lines = [], []
    for p in planned:
        if p.skipped:
            lines.append(f"# skip {p.name}: {p.skipped}")
        elif states is not None and not states[p.name][0]:
            lines.append(f"# {p.name}: {states[p.name][1]}; not run again")
        else:
            if states is not None:
                lines.append(f"# {p.name}: {states[p.name][1]}")
            lines.append(p.command)
            todo.append(p)
    return todo, lines


# --------------------------------------------------------------------------------------------
# Running: one attempt each, recorded in study.json
# --------------------------------------------------------------------------------------------

def child_env(p: Planned) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(dict(p.env))
    if p.env:  # --local: psrecord and friends from this interpreter's environment
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def submit(p: Planned, study: Path) -> dict:
    """One sbatch; a failure is the attempt's "error", which stops the study."""
    attempt = {"job_id": "", "submitted": _now(), "command": p.command}
    try:
        out = subprocess.run(list(p.argv), capture_output=True, text=True, env=child_env(p),
                             timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return attempt | {"error": f"sbatch for {p.name} did not run ({e})"}
    job_id = out.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    if out.returncode != 0 or not job_id.isdigit():
        said = " / ".join((out.stderr or out.stdout).strip().splitlines())
        return attempt | {"error": f"sbatch for {p.name} failed (exit {out.returncode}): "
                                   f"{said[:300]}"}
    attempt.update(job_id=job_id, run_dir=str(study / f"{p.name}-{job_id}"))
    print(f"submitted {p.name}: job {job_id} -> {attempt['run_dir']}", flush=True)
    return attempt


def run_local(p: Planned, study: Path) -> dict:
    """One local run, its output to the terminal and STUDY/<name>-<time>.out; exit code 130
    when Ctrl-C stopped it."""
    before = set(study.glob(f"{p.name}-*/"))
    output = study / f"{p.name}-{datetime.now():%Y%m%d-%H%M%S}.out"
    attempt = {"job_id": "", "submitted": _now(), "command": p.command, "output": str(output)}
    print(f"== {p.name}: {p.command}", flush=True)
    with open(output, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(list(p.argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=child_env(p), errors="replace")
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.wait()  # the run got the same SIGINT (same terminal): let it clean up
            rc = 130
    new = sorted(set(study.glob(f"{p.name}-*/")) - before)
    if new:
        attempt["run_dir"] = str(new[-1])
        attempt["job_id"] = new[-1].name[len(p.name) + 1:]
    attempt["exit_code"] = rc
    print(f"== {p.name}: exit code {rc}"
          + (f" -> {attempt['run_dir']}" if new else " (no run directory)"), flush=True)
    return attempt


# --------------------------------------------------------------------------------------------
# The study, start to end
# --------------------------------------------------------------------------------------------

def study(args, train_args: list, argv: list) -> int:
    mode = "local" if args.local else "slurm"
    study_dir, manifest, settings = open_study(args, settings_from(args, train_args), mode)
    existed = study_dir.is_dir()
    locks = [hold_study(study_dir, args.dry_run)]  # held while this process runs
    check_train_args_parse(settings["train_args"], settings["strategies"])
    if mode == "slurm" and not args.dry_run and shutil.which("sbatch") is None:
        raise StudyError("sbatch not found: run this on the cluster's login node, or use "
                         "--dry-run to print the commands or --local to run on this machine")

    planned = plan(settings, study_dir, args.local, local_gpus() if args.local else 0)
    states = (resume_states(study_dir, manifest, [p.name for p in planned if not p.skipped])
              if args.resume else None)
    if planned and all(p.skipped for p in planned) and not args.dry_run:
        reasons = list(dict.fromkeys(p.skipped for p in planned))
        raise StudyError(f"nothing to run: all {len(planned)} configuration(s) are skipped: "
                         f"{'; '.join(reasons)}")
    todo, lines = select(planned, states)
    mode_text = (f"weak scaling, {settings['per_gpu_batch']} images per GPU"
                 if settings["scaling"] == "weak"
                 else f"strong scaling, global batch {settings['global_batch']}")
    header = (f"# study {study_dir}: {mode_text}; {len(planned)} configurations, "
              f"{sum(bool(p.skipped) for p in planned)} skipped, {len(todo)} to run")
    if args.dry_run:  # a script to run as it is: sbatch's --output needs the folder first
        print("\n".join([header, f"mkdir -p {shlex.quote(str(study_dir))}"] + lines))
        return 0

    entries = record_plan(study_dir, manifest, settings, planned, args.resume, argv)
    if not existed:  # a new study's folder is made by record_plan
        locks.append(hold_study(study_dir))
    print("\n".join([header] + [ln for ln in lines if ln.startswith("#")]), flush=True)
    shown = shlex.quote(str(study_dir))  # commands to paste: a space or $ in the path too
    resume_cmd = (f"python launch/run_benchmarks.py --resume --study-dir {shown}"
                  + (" --local" if args.local else ""))
    failed = []
    try:
        for p in todo:
            attempt = run_local(p, study_dir) if args.local else submit(p, study_dir)
            entries[p.name]["attempts"].append(attempt)
            write_manifest(study_dir, manifest)
            if "error" in attempt:
                print(f"error: {attempt['error']}; fix it and submit the rest with: "
                      f"{resume_cmd}", file=sys.stderr)
                return 1
            if attempt.get("exit_code") == 130:
                raise KeyboardInterrupt
            if attempt.get("exit_code", 0) != 0:
                failed.append(f"{p.name} (exit code {attempt['exit_code']})")
    except KeyboardInterrupt:
        write_manifest(study_dir, manifest)
        print(f"\ninterrupted; finish the study with: {resume_cmd}", file=sys.stderr)
        return 130

    if args.local:
        print(f"{len(todo) - len(failed)} of {len(todo)} runs ok"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    else:
        print(f"{len(todo)} jobs submitted; watch them with: squeue --me")
    print(f"study: {study_dir}\nwhen done: python collect_results.py {shown} --plot"
          + (f"\nrerun what failed: {resume_cmd}" if failed else ""))
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    at = argv.index("--") if "--" in argv else len(argv)
    ours, parser = argv[:at], build_parser()
    # argparse takes `--sbatch-args --partition=gpu` for two options: join them, unless the
    # second is one of ours (or argparse's abbreviation of one), a forgotten value
    names = [o for o in parser._option_string_actions if o.startswith("--")]
    for i in range(len(ours) - 1, 0, -1):
        name = ours[i].split("=", 1)[0]
        if (ours[i - 1] == "--sbatch-args" and ours[i].startswith("-")
                and not any(o.startswith(name) for o in names)):
            ours[i - 1:i + 1] = [f"--sbatch-args={ours[i]}"]
    args = parser.parse_args(ours)  # ours; the flags after "--" are the training's
    try:
        return study(args, argv[at + 1:], argv)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
