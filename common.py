"""What the three training scripts share because it changes a measured number.

dp_train.py, ddp_train.py and fsdp_train.py each keep inline what a strategy *is* (process
group, model wrapper, sampler, training step, metric reduction, saving). This module holds what
must be identical across them so their numbers can be compared:

- the command-line flags (``add_common_args``) and their resolved defaults (``resolve_args``),
- the datasets (TinyImageNet in its original layout, CIFAR-10, MNIST, built-in synthetic data),
- the models (ResNet-50 and any torchvision classifier, the CIFAR-10 CNN, the MNIST net),
- the evaluation pass (``evaluate``), which counts every validation sample exactly once,
- the output contract: the epoch line and the ``[METRIC]`` line with its list of keys
  (``METRIC_KEYS``), which collect_results.py imports so the two cannot drift,
- memory statistics and the distributed environment as torchrun or Slurm describe it.

Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

# --------------------------------------------------------------------------------------------
# Output contract
# --------------------------------------------------------------------------------------------

#: Keys of every ``[METRIC]`` line, in order. The final line adds ``FINAL_KEYS``.
METRIC_KEYS = (
    "strategy", "model", "dataset", "device", "world_size", "nodes", "gpus_per_node",
    "per_gpu_batch", "global_batch", "amp", "epoch", "epochs", "lr",
    "train_loss", "train_acc", "val_loss", "val_acc", "train_images", "val_images",
    "epoch_time_s", "throughput_img_s", "peak_mem_mib", "peak_mem_per_gpu_mib",
)
#: Extra keys of the one ``[METRIC]`` line printed after the last epoch (``final=1``).
FINAL_KEYS = ("final", "total_time_s")
METRIC_PREFIX = "[METRIC]"

#: Exit code after a checkpoint taken on SIGUSR1/SIGTERM: "requeue me, I will resume".
REQUEUE_EXIT = 75
#: Exit code when the loss became NaN/inf (nothing was saved over the last good checkpoint).
NONFINITE_EXIT = 3
#: The line rank 0 prints when a stop signal ended the run; launch/job.sh requeues the job
#: when it reads one with saved=1 (torchrun reports its workers' exit 75 as 1).
STOP_PREFIX = "[STOP]"
STOP_LINE = (STOP_PREFIX + " signal={signal} epoch={epoch} step={step} saved={saved} "
             "exit_code={code}")

EPOCH_LINE = ("Epoch [{epoch}/{epochs}] LR: {lr:.6f} | Loss (train, val): {train_loss:.3f}, "
              "{val_loss:.3f} | Accuracy (train, val): {train_acc:.2f}%, {val_acc:.2f}% | "
              "Throughput: {throughput_img_s:.1f} img/s")


def format_epoch_line(m: dict) -> str:
    """The per-epoch line users know from the workshop (values global across ranks)."""
    return EPOCH_LINE.format(**m)


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return "nan" if math.isnan(value) else format(value, ".7g")
    if isinstance(value, (list, tuple)):  # per-GPU values: "812.5/640.1"
        return "/".join(_fmt(v) for v in value)
    text = str(value)
    return text.replace(" ", "_") or "-"


def format_metric_line(m: dict, final: bool = False) -> str:
    """``[METRIC] key=value ...`` with exactly METRIC_KEYS (+ FINAL_KEYS on the last line)."""
    keys = METRIC_KEYS + (FINAL_KEYS if final else ())
    missing = [k for k in keys if k not in m and k != "final"]
    if missing:
        raise KeyError(f"metric line lacks {missing}")
    values = dict(m, final=1)
    return METRIC_PREFIX + " " + " ".join(f"{k}={_fmt(values[k])}" for k in keys)


def parse_metric_line(line: str) -> dict | None:
    """Parse one ``[METRIC]`` line into {key: str}; None when the line is not one."""
    at = line.find(METRIC_PREFIX)
    if at < 0:
        return None
    fields = {}
    for token in line[at + len(METRIC_PREFIX):].split():
        key, sep, value = token.partition("=")
        if not sep:
            return None
        fields[key] = value
    return fields if all(k in fields for k in METRIC_KEYS) else None


# --------------------------------------------------------------------------------------------
# Run: errors and exit codes, print0, stop signals, the watchdog
# --------------------------------------------------------------------------------------------

class UsageError(Exception):
    """A problem the user can fix: printed as one sentence naming the fix, exit code 2."""


class DataError(UsageError):
    """A UsageError about the data one rank read (an unreadable image with --strict): only
    that rank sees it, so that rank prints it, whichever it is."""


def fail_cleanly(err: UsageError, rank_env: "DistEnv | None" = None) -> int:
    """Print a UsageError as one line and return 2. A problem of the setup is the same on
    every rank: local rank 0 of each node prints it. A DataError (or any error raised in a
    DataLoader worker) is this rank's own: it prints it, prefixed with its rank unless 0."""
    text = str(err)
    from_worker = "Original Traceback" in text
    if from_worker:  # raised in a DataLoader worker: keep only its sentence
        text = re.sub(r"^.*?(Usage|Data)Error: ", "", text.strip().splitlines()[-1])
    own = isinstance(err, DataError) or from_worker
    if rank_env is None or rank_env.local_rank == 0 or own:
        rank = f"rank {rank_env.rank}: " if own and rank_env and rank_env.rank else ""
        print(f"error: {rank}{text}", file=sys.stderr, flush=True)
    else:  # a silent rank that exits first makes torchrun stop the node's other ranks (SIGTERM):
        time.sleep(2)  # give local rank 0 the moment it needs to print the same error
    return 2


def end_process(code: int) -> None:
    """Exit with ``code`` without the interpreter's teardown: the checkpoint dir's lock is
    released, DataLoader workers and other child processes are stopped first, stdio is
    flushed. Some torch releases (2.15 on CPU/gloo) can abort in a C++ destructor during
    teardown ("terminate called without an active exception", SIGABRT) after the process
    group is destroyed, turning a finished run into a failed job."""
    import multiprocessing
    import signal
    release_checkpoint_lock()
    if threading.current_thread() is threading.main_thread():  # (else: the SIGTERM thread)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the DataLoader's would raise below
    for child in multiprocessing.active_children():
        child.kill()  # the run is over; a loader worker ignores SIGTERM (_child_signals)
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def print0(*values) -> None:
    """print on rank 0 only (the rank that run() found), flushed: logs are read with tail -f."""
    if _Signals.rank == 0:
        print(*values, flush=True)


def run(train, parser: argparse.ArgumentParser, argv=None) -> int:
    """What every training script does around its ``train(args, env)``, so each script keeps
    only the lesson: parse the flags; find the rank layout (torchrun, srun or one process);
    catch the stop signals from the start; start the watchdog; map what went wrong to an exit
    code (2: a problem the user can fix, NONFINITE_EXIT: NaN loss, 1: a collective failed,
    anything else: its traceback); and, once every rank has finished, the last barrier and
    the process group's teardown. Returns the exit code for end_process."""
    args = parser.parse_args(argv)
    env = None
    try:
        env = dist_env()
        catch_stop_signals(env.rank)  # from the start: a signal is never lost
        start_watchdog(env, args.dist_timeout)  # ends this worker if orphaned or frozen
        rc = train(args, env)
        if dist.is_initialized():  # let every rank finish its last collective before any of
            dist.barrier()  # them tears gloo/NCCL down (else: an abort at exit)
        return rc
    except UsageError as err:
        return fail_cleanly(err, env)
    except NonFiniteLoss as err:  # every rank raises it at the same check (a vote)
        if env is None or env.rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT
    except RuntimeError as err:  # a peer died or a collective timed out: never hang
        if not is_collective_failure(err):
            raise
        return collective_failed(err, env)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: Words of the errors that gloo and NCCL raise as plain RuntimeError when a peer is lost.
COLLECTIVE_ERROR_WORDS = ("gloo", "nccl", "connection closed by peer", "connection reset by "
                          "peer", "broken pipe", "timed out")


def is_collective_failure(err: BaseException) -> bool:
    """Did a collective fail (a peer died, the network broke, a timeout)? torch raises
    dist.DistError for some of these; gloo raises a plain RuntimeError (also from inside
    DDP's backward), so its message and where it was raised count too."""
    if isinstance(err, dist.DistError):
        return True
    if not isinstance(err, RuntimeError) or isinstance(err, torch.OutOfMemoryError):
        return False  # an OOM inside FSDP's hooks is an OOM, not a lost peer
    text = str(err).lower()
    if any(word in text for word in COLLECTIVE_ERROR_WORDS):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    # raised by a collective call itself (the innermost frame is torch's c10d module)?
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith("distributed_c10d.py")


def collective_failed(err: Exception, rank_env: "DistEnv | None") -> int:
    """A collective failed or timed out (a peer died, the network broke): say so and exit 1
    instead of waiting forever."""
    rank = rank_env.rank if rank_env else 0
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    print(f"error: rank {rank}: a collective with the other ranks failed or timed out "
          f"({err.__class__.__name__}: {first}); another rank probably died first: look for its "
          f"error above, or raise --dist-timeout if the job is merely slow", file=sys.stderr,
          flush=True)
    return 1


class _Signals:
    """SIGUSR1 (Slurm's warning before the time limit) and SIGTERM (preemption), caught from
    the first line of main(). Once training runs, StopRequest turns them into a checkpoint and
    REQUEUE_EXIT; before that a SIGTERM ends the process at once, saying so."""
    signum = 0          # the last stop signal received
    training = False    # set by StopRequest: from now on a signal is handled at a step
    rank = 0
    installed = False


def catch_stop_signals(rank: int) -> None:
    """Python runs a signal handler in the main thread only, between two bytecodes: a main
    thread blocked in the process-group start or a collective would hold a SIGTERM back for
    up to --dist-timeout. So the handler does nothing, and the signal's number reaches a
    thread at once through the wakeup pipe (signal.set_wakeup_fd), which acts on it."""
    import signal
    _Signals.rank = rank
    if _Signals.installed:
        return
    _Signals.installed = True
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    os.register_at_fork(after_in_child=_child_signals)
    threading.Thread(target=_watch_signals, args=(read_end,), daemon=True).start()


def _child_signals() -> None:
    """In a forked DataLoader or cache worker: no wakeup pipe (its signals are not the run's),
    and the stop signals ignored; the worker ends with its parent."""
    import signal
    signal.set_wakeup_fd(-1)
    ignore_stop_signals()


def ignore_stop_signals(worker_id=None) -> None:
    """Slurm and torchrun send SIGTERM (and job.sh SIGUSR1) to every process of the job, the
    DataLoader workers too: those must live on while their rank saves its stop checkpoint.
    Also a DataLoader worker_init_fn, because torch installs its own SIGTERM handler there."""
    import signal
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _watch_signals(read_end: int) -> None:
    import signal
    while True:
        for signum in os.read(read_end, 64):
            if signum not in (signal.SIGUSR1, signal.SIGTERM):
                continue
            _Signals.signum = signum
            if signum == signal.SIGTERM and not _Signals.training:
                if _Signals.rank == 0:
                    print("SIGTERM during start-up, before the first training step: stopping "
                          "now (nothing to checkpoint yet)", file=sys.stderr, flush=True)
                end_process(128 + signum)


_WATCHDOG = r"""
import os, select, signal, sys, time
worker, launcher, timeout, rank = map(int, sys.argv[1:])
last = time.monotonic()
for sig in (signal.SIGUSR1, signal.SIGTERM):  # sent to the whole job: the worker acts on them
    signal.signal(sig, signal.SIG_IGN)

def parent_and_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0]
    except (OSError, ValueError, IndexError):
        return None, "X"

def end(reason):
    print(f"error: rank {rank}: {reason}: ending it (pid {worker}) so that the job ends on "
          f"every node", file=sys.stderr, flush=True)
    try:
        os.kill(worker, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.exit(0)

while True:
    if select.select([0], [], [], 1.0)[0]:
        if not os.read(0, 4096):
            sys.exit(0)  # the worker closed its end: it has exited
        last = time.monotonic()
    parent, state = parent_and_state(worker)
    if state in "XZ":
        sys.exit(0)
    if launcher and parent != launcher:
        end(f"its launcher (torchrun, pid {launcher}) is gone")
    if time.monotonic() - last > timeout:
        end(f"no sign of life for {timeout} s ({'stopped' if state == 'T' else 'hung'})")
"""


def start_watchdog(env: "DistEnv", timeout_s: int) -> None:
    """A small process beside each worker of a multi-process run that ends the worker when
    (a) its launcher is gone: torchrun starts workers in their own session, so a SIGKILLed
    torchrun would leave them training on as orphans, writing checkpoints; or (b) it has
    shown no sign of life for ``timeout_s`` (--dist-timeout): a stopped or hung rank, which
    its peers give up on after the same time, would otherwise keep its node's torchrun
    waiting forever. The worker's sign of life is a byte a thread writes to a pipe every
    second; the watchdog leaves by itself when the worker ends."""
    by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun for its workers
    if not by_torchrun and not (env.source == "slurm" and env.world_size > 1):
        return
    launcher = os.getppid() if by_torchrun else 0
    read_end, write_end = os.pipe()
    silence = max(timeout_s, 10)  # well above the 1 s beat, even for a tiny --dist-timeout
    subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(launcher),
                      str(silence), str(env.rank)], stdin=read_end, close_fds=True)
    os.close(read_end)
    os.set_blocking(write_end, False)

    def beat():
        while True:
            try:
                os.write(write_end, b".")
            except BlockingIOError:
                pass
            except OSError:
                return
            time.sleep(1)
    threading.Thread(target=beat, daemon=True).start()


def report_skipped(train_seen: float, train_expected: int, val_seen: float,
                   val_total: int) -> None:
    """End-of-epoch count of images dropped because they could not be read."""
    skipped_train = int(train_expected - train_seen)
    skipped_val = int(val_total - val_seen)
    if skipped_train > 0 or skipped_val > 0:
        print0(f"warning: skipped {skipped_train} unreadable training and {skipped_val} "
               f"validation image(s) this epoch (see the warnings above; --strict stops at "
               f"the first)")


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------

DATASETS = ("tinyimagenet", "cifar10", "mnist", "synthetic")
DEFAULT_MODEL = {"tinyimagenet": "resnet50", "cifar10": "cnn", "mnist": "mnist_net",
                 "synthetic": "resnet50"}


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every training script takes, with the same names, defaults and meaning."""
    g = parser.add_argument_group("data and model")
    g.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or None,
                   help="dataset root (default: $DATA_DIR). For TinyImageNet the folder holding "
                        "wnids.txt, train/ and val/ in the original layout")
    g.add_argument("--dataset", choices=DATASETS, default=None,
                   help="default: tinyimagenet when a data dir is given, else synthetic "
                        "(built-in, learnable, no download)")
    g.add_argument("--model", default=None,
                   help="resnet50, cnn (CIFAR-10 CNN), mnist_net, or any torchvision "
                        "classification model name; default follows the dataset "
                        "(tinyimagenet/synthetic: resnet50, cifar10: cnn, mnist: mnist_net)")
    g.add_argument("--data-cache", nargs="?", const="auto", default=None, metavar="DIR",
                   help="TinyImageNet only: decode each split once into a memory-mapped uint8 "
                        "array in DIR (no DIR: a folder beside the data dir, or ~/.cache when "
                        "that is read-only) and augment batches on the device; far faster than "
                        "decoding JPEGs every epoch")
    g.add_argument("--data-on-device", action="store_true",
                   help="hold the whole dataset on the device and index batches there: no "
                        "DataLoader, no host-to-device copy (needs --data-cache or synthetic "
                        "data; TinyImageNet's uint8 train split takes 1.2 GB, counted in the "
                        "peak memory)")
    g.add_argument("--synthetic-size", type=int, default=2048,
                   help="training samples of the synthetic dataset (validation gets a quarter)")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=3, help="number of epochs")
    g.add_argument("--batch-size", type=int, default=64,
                   help="batch size PER PROCESS/GPU; the global batch is this times the number "
                        "of GPUs and is printed at start")
    g.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    g.add_argument("--step-size", type=int, default=2,
                   help="StepLR: multiply the learning rate by --gamma every this many epochs")
    g.add_argument("--gamma", type=float, default=0.1, help="StepLR decay factor")
    g.add_argument("--amp", choices=("fp16", "bf16", "off"), default=None,
                   help="mixed precision: fp16 (autocast + GradScaler), bf16 (autocast, no "
                        "scaler) or off; default bf16 on GPUs of compute capability 8.0+ (A100, "
                        "H100), fp16 on older GPUs (V100), off on CPU")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (first steps are slower while it compiles)")
    g = parser.add_argument_group("run")
    g.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers per process (default: from $SLURM_CPUS_PER_TASK or "
                        "the CPUs this process may use, shared by the processes of the node, "
                        "at most 8)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for model init, shuffling and synthetic data")
    g.add_argument("--max-steps-per-epoch", type=int, default=0,
                   help="stop each training epoch after this many steps (0 = whole epoch); "
                        "for smoke runs and benchmarks")
    g.add_argument("--save-model", default=None, metavar="PATH",
                   help="at the end rank 0 saves the unwrapped model's state_dict here "
                        "(load with torch.load(PATH, weights_only=True))")
    g.add_argument("--dist-timeout", type=int, default=600,
                   help="seconds a collective or the process-group start may wait for other "
                        "ranks before the run fails instead of hanging")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first unreadable image (naming it) instead of skipping it")
    g.add_argument("--check", action="store_true",
                   help="run only the preflight checks and an all-reduce sanity and bandwidth "
                        "test across all ranks, then exit")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save a checkpoint here at the end of every epoch (and every "
                        "--checkpoint-every steps); resume from it with --resume auto")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N training steps (0 = only at epoch ends)")
    g.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                   help="keep the newest K checkpoints, delete older ones")
    g.add_argument("--resume", default="auto", metavar="{auto,never,PATH}",
                   help="auto: continue from the newest usable checkpoint in --checkpoint-dir "
                        "(a fresh start if there is none); never: always start fresh; PATH: "
                        "this checkpoint")
    return parser


def _default_workers(env: "DistEnv") -> int:
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    try:
        total = int(cpus) if cpus else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        total = os.cpu_count() or 1
    # torchrun starts the node's processes inside ONE Slurm task: they share its CPUs.
    # Started by srun directly, each process is its own task with its own CPUs.
    share = total // env.local_world_size if env.source == "torchrun" else total
    return max(0, min(8, share - 1))


def resolve_args(args: argparse.Namespace, env: "DistEnv", device: torch.device) -> None:
    """Fill the defaults that depend on other flags or on the machine; reject impossible ones."""
    if args.dataset is None:
        args.dataset = "tinyimagenet" if args.data_dir else "synthetic"
    if args.model is None:
        args.model = DEFAULT_MODEL[args.dataset]
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        bf16_ok = cc >= (8, 0)  # Ampere and newer: bf16 tensor cores
        if args.amp is None:  # bf16 needs no GradScaler; fp16 (the seed's) on V100 and older
            args.amp = "bf16" if bf16_ok else "fp16"
        elif args.amp == "bf16" and not bf16_ok:
            raise UsageError(f"--amp bf16 needs a GPU of compute capability 8.0 or newer (A100, "
                             f"H100, ...); {torch.cuda.get_device_name(device)} has "
                             f"{cc[0]}.{cc[1]}: use --amp fp16")
    elif args.amp is None:
        args.amp = "off"
    elif args.amp != "off" and env.rank == 0:  # autocast on a CPU: slow kernels, no gain
        print(f"warning: --amp {args.amp} on a CPU trains many times slower than --amp off "
              f"(CPUs lack fast {args.amp} kernels); mixed precision pays off on GPUs: use "
              f"--amp off here", file=sys.stderr, flush=True)
    if args.num_workers is None:
        args.num_workers = _default_workers(env)
        if device.type == "cuda":  # with 0, reading and pinning a batch delays every step
            args.num_workers = max(1, args.num_workers)
    for flag in ("epochs", "batch_size", "synthetic_size", "step_size", "dist_timeout"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, flag)}")
    if args.keep_checkpoints < 1:
        raise UsageError("--keep-checkpoints must be at least 1")
    if args.resume not in ("auto", "never") and not Path(args.resume).exists():
        raise UsageError(f"--resume {args.resume}: no such checkpoint; use auto, never, or the "
                         f"path of a checkpoint file or folder")
    for flag in ("num_workers", "max_steps_per_epoch", "checkpoint_every"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} cannot be negative")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    check_model(args.model, input_shape(args))  # before any download or data scan
    if args.data_on_device and args.dataset != "synthetic" and not args.data_cache:
        raise UsageError("--data-on-device needs decoded data: add --data-cache (TinyImageNet) "
                         "or use the synthetic dataset")
    if args.data_cache and args.dataset != "tinyimagenet":
        raise UsageError(f"--data-cache works with TinyImageNet only, not --dataset "
                         f"{args.dataset}: drop --data-cache")


def input_shape(args) -> tuple:
    """Image shape (C, H, W) the dataset delivers; synthetic data takes the model's."""
    fixed = {"tinyimagenet": (3, 64, 64), "cifar10": (3, 32, 32), "mnist": (1, 28, 28)}
    return fixed.get(args.dataset) or synthetic_shape(args.model)[0]


def amp_dtype(args) -> torch.dtype | None:
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[args.amp]


AMP_TEXT = {"fp16": "fp16 autocast with GradScaler", "bf16": "bf16 autocast, no GradScaler",
            "off": "off (fp32)"}


def seed_for_rank(seed: int, rank: int) -> int:
    """The seed of one rank's own randomness: crops, flips, dropout, DataLoader workers.

    Model init uses ``seed`` itself on every rank (identical weights). Everything drawn after
    it must differ between ranks, or rank r's i-th sample gets the same crop as rank 0's i-th
    sample at every step; it stays reproducible from (seed, rank)."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


# --------------------------------------------------------------------------------------------
# Distributed environment (torchrun, or srun without torchrun)
# --------------------------------------------------------------------------------------------

@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    source: str  # "torchrun", "slurm" or "single"
    num_nodes: int = 0  # 0: world_size / local_world_size (torchrun's even layout)

    @property
    def nodes(self) -> int:
        return self.num_nodes or max(1, self.world_size // max(1, self.local_world_size))


def _int_env(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise UsageError(f"${name}={os.environ[name]!r} is not an integer: unset it or fix the "
                         f"launcher that sets it") from None


def dist_env() -> DistEnv:
    """Rank layout from torchrun (RANK/LOCAL_RANK/WORLD_SIZE) or, started by ``srun`` without
    torchrun, from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; one process otherwise.

    Under the Slurm fallback MASTER_ADDR defaults to the step's first node and MASTER_PORT to
    20000 + job id % 20000 (the launchers use the same rule), so ``srun python ddp_train.py``
    works without extra exports.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = _int_env("WORLD_SIZE")
        local_world = (_int_env("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ
                       else world)
        return DistEnv(_int_env("RANK"), _int_env("LOCAL_RANK") if "LOCAL_RANK" in os.environ
                       else 0, world, local_world, "torchrun")
    # SLURM_STEP_ID is set inside an srun step, not in the batch script itself, where
    # SLURM_NTASKS describes the whole job and one plain `python` would wait for its peers.
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ:
        world = _int_env("SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in os.environ \
            else _int_env("SLURM_NTASKS")
        nodes = _int_env("SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in os.environ \
            else _int_env("SLURM_NNODES") if "SLURM_NNODES" in os.environ else 1
        env = DistEnv(_int_env("SLURM_PROCID"), _int_env("SLURM_LOCALID"), world,
                      _slurm_tasks_on_this_node(world, nodes), "slurm", nodes)
        if world > 1 and "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = _slurm_first_node()
        if world > 1:
            job = os.environ.get("SLURM_JOB_ID", "0")
            os.environ.setdefault("MASTER_PORT", str(20000 + int(job) % 20000))
        return env
    return DistEnv(0, 0, 1, 1, "single")


def _slurm_tasks_on_this_node(world: int, nodes: int) -> int:
    """Tasks of this step on this node. Slurm may place them unevenly (5 tasks on 2 nodes:
    SLURM_STEP_TASKS_PER_NODE="3,2"; "2(x3),1" means 2 on each of three nodes, then 1), so
    world // nodes is only the last resort."""
    counts = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            counts = []
            break
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = os.environ.get("SLURM_NODEID", "0")
    if counts and node.isdigit() and int(node) < len(counts):
        return counts[int(node)]
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return int(per_node)
    return max(1, world // max(1, nodes))


def gpu_index(visible: int, local_rank: int, local_world_size: int, source: str) -> int:
    """Which of the ``visible`` GPUs this process drives (a pure function of the layout).

    - One GPU visible to a process that srun started as its own task: srun --gpus-per-task=1
      or --gpu-bind gave each task its own GPU, always cuda:0 inside the task.
    - Otherwise local rank i drives GPU i, so the node needs a GPU per local process.
    """
    if visible == 1 and (source == "slurm" or local_world_size == 1):
        return 0
    if local_world_size > visible:
        fix = (f"use --nproc-per-node {visible}" if source == "torchrun" else
               f"start {visible} task(s) per node, or give each task its own GPU with srun "
               f"--gpus-per-task=1")
        raise UsageError(f"{local_world_size} processes were started on this node but only "
                         f"{visible} GPU(s) are visible: {fix} (or request more GPUs)")
    return local_rank


def _slurm_first_node() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UsageError("started by srun but SLURM_JOB_NODELIST is unset: export MASTER_ADDR "
                         "and MASTER_PORT, or start the job with torchrun")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True, timeout=30).stdout.split()
        return out[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        raise UsageError(f"could not expand the Slurm node list {nodelist!r} with scontrol: "
                         f"export MASTER_ADDR=<first node> before srun") from None


def init_process_group(backend: str, env: DistEnv, timeout_s: int) -> None:
    """Join the global process group (all ranks). A single process gets an in-memory store,
    so `python script.py` needs no MASTER_ADDR/PORT and runs the same DDP/FSDP code path."""
    from datetime import timedelta
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise UsageError("MASTER_PORT is not set: start with torchrun (which sets it) or "
                             "export MASTER_ADDR and MASTER_PORT")
        dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=timeout)


def on_rank0(fn):
    """Run ``fn`` on rank 0 only while the other ranks wait; a UsageError there is raised on
    every rank (through a broadcast), so nobody waits forever. Without a process group
    (DataParallel) it simply runs ``fn``."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except UsageError as exc:
            error = str(exc)
    box = [error]
    dist.broadcast_object_list(box, src=0)  # collective: every rank waits here for rank 0
    if box[0] is not None:
        raise UsageError(box[0])
    return result


def rank0_first(fn):
    """Run ``fn`` (e.g. a download) on rank 0 while the other ranks wait, then on the others."""
    result = on_rank0(fn)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return fn()
    return result


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

IMG_EXTENSIONS = (".jpeg", ".jpg", ".png")
NORMALIZE = {  # channel mean and std of each dataset's training split
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "mnist": ((0.1307,), (0.3081,)),
}


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple  # (C, H, W)
    name: str
    description: str
    device_augment: "DeviceAugment | None" = None  # cache path: uint8 batches finished on device


class ImageList(Dataset):
    """(path, label) pairs read with PIL. Used for TinyImageNet train and val alike.

    An unreadable image (corrupt, truncated, zero bytes) becomes None, which
    ``collate_skip_unreadable`` drops from its batch, with a warning naming the file; with
    ``strict`` it raises a UsageError naming the file instead. Either way the DataLoader
    worker does not crash.
    """

    def __init__(self, samples, transform, strict: bool = False):
        self.samples = samples
        self.targets = [label for _, label in samples]
        self.transform = transform
        self.strict = strict

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        from PIL import Image
        path, label = self.samples[index]
        try:
            with Image.open(path) as img:  # some TinyImageNet images are greyscale
                img = img.convert("RGB")
        except (OSError, ValueError, SyntaxError) as exc:  # PIL's errors for broken files
            reason = f"{exc.__class__.__name__}: {str(exc)[:100]}"
            if self.strict:
                raise DataError(f"unreadable image {path} ({reason}): replace or delete it, "
                                f"or drop --strict to skip such files") from None
            print(f"warning: skipping unreadable image {path} ({reason})", file=sys.stderr,
                  flush=True)
            return None
        return self.transform(img), label


def collate_skip_unreadable(batch):
    """default_collate without the samples ImageList could not read."""
    from torch.utils.data import default_collate
    kept = [item for item in batch if item is not None]
    if not kept:
        raise DataError(f"all {len(batch)} images of a batch are unreadable: the data dir is "
                        f"damaged; restore it from the dataset archive")
    return default_collate(kept)


def collate_val(batch):
    """collate_skip_unreadable plus a bool mask over the sampler's batch: which positions
    survived. evaluate() needs it to tell real samples from the DistributedSampler's padding
    once an unreadable image has been dropped and the positions after it have shifted."""
    survived = torch.tensor([item is not None for item in batch])
    return (*collate_skip_unreadable(batch), survived)


def read_text_file(path: Path) -> str:
    """A dataset text file (wnids.txt, val_annotations.txt) as str, or a UsageError naming it
    when it cannot be read or is not UTF-8 text (a damaged or wrong file)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not a text file (bytes that are not UTF-8 at offset "
                         f"{exc.start}): restore it from the dataset archive") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path} ({exc.strerror or exc}): make it readable or "
                         f"restore it from the dataset archive") from None


def _images_in(folder: Path) -> list:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMG_EXTENSIONS)


def scan_tinyimagenet(root) -> tuple:
    """Read TinyImageNet's ORIGINAL layout: classes from wnids.txt (sorted), train images from
    train/<wnid>/images/, val labels from val/val_annotations.txt (val/images/ is one flat
    folder; reading it with ImageFolder would give every image the same label). A val folder
    already split into val/<wnid>/[images/] is accepted too.

    Returns (classes, train_samples, val_samples) with samples as (path, class index).
    """
    root = Path(root)
    hint = "point --data-dir at the tiny-imagenet-200 folder (it holds wnids.txt, train/, val/)"
    if not root.is_dir():
        raise UsageError(f"data dir {root} does not exist: {hint}")
    wnids_file = root / "wnids.txt"
    if not wnids_file.is_file():
        raise UsageError(f"{wnids_file} is missing: {hint}")
    classes = sorted({w.strip() for w in read_text_file(wnids_file).split() if w.strip()})
    if not classes:
        raise UsageError(f"{wnids_file} lists no class ids: restore it from the dataset archive")
    index = {wnid: i for i, wnid in enumerate(classes)}

    train_dir = root / "train"
    if not train_dir.is_dir():
        raise UsageError(f"{train_dir} is missing: {hint}")
    for d in sorted(p for p in train_dir.iterdir() if p.is_dir()):
        if d.name not in index:
            raise UsageError(f"train/{d.name} is not listed in wnids.txt: remove the folder "
                             f"or restore wnids.txt from the dataset archive")
    train = []
    for wnid in classes:
        folder = train_dir / wnid / "images"
        if not folder.is_dir():
            folder = train_dir / wnid
        if not folder.is_dir():
            raise UsageError(f"no training folder for class {wnid} (expected "
                             f"{train_dir / wnid / 'images'}): {hint}")
        images = _images_in(folder)
        if not images:
            raise UsageError(f"{folder} holds no images: restore it from the dataset archive")
        train += [(str(p), index[wnid]) for p in images]

    val_dir = root / "val"
    annotations = val_dir / "val_annotations.txt"
    val = []
    if annotations.is_file():
        images_dir = val_dir / "images"
        for lineno, line in enumerate(read_text_file(annotations).splitlines(), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 2:
                raise UsageError(f"{annotations}:{lineno} is malformed (expected "
                                 f"'<file> <wnid> ...'): restore it from the dataset archive")
            name, wnid = parts[0], parts[1]
            if wnid not in index:
                raise UsageError(f"{annotations}:{lineno} names class {wnid}, which is not in "
                                 f"wnids.txt: the data dir mixes two datasets; restore both "
                                 f"files from the same archive")
            path = images_dir / name
            if not path.is_file():
                raise UsageError(f"{annotations}:{lineno} names {path}, which does not exist: "
                                 f"restore val/images/ from the dataset archive")
            val.append((str(path), index[wnid]))
        annotated = {Path(p).name for p, _ in val}
        stray = [p.name for p in _images_in(images_dir) if p.name not in annotated] \
            if images_dir.is_dir() else []
        if stray:
            raise UsageError(f"{len(stray)} image(s) in {images_dir} have no line in "
                             f"{annotations} (first: {stray[0]}): restore both from the same "
                             f"dataset archive")
    elif val_dir.is_dir() and any((val_dir / w).is_dir() for w in classes):
        for wnid in classes:  # already reorganised into one folder per class
            folder = val_dir / wnid / "images" if (val_dir / wnid / "images").is_dir() \
                else val_dir / wnid
            if folder.is_dir():
                val += [(str(p), index[wnid]) for p in _images_in(folder)]
    else:
        raise UsageError(f"{annotations} is missing and val/ is not split into class folders: "
                         f"the labels of val/images/ live only in val_annotations.txt; restore "
                         f"it from the dataset archive")
    if not val:
        raise UsageError(f"{val_dir} holds no validation images: restore it from the archive")
    return classes, train, val


class SyntheticImages(Dataset):
    """Learnable, deterministic stand-in data: each class has its own smooth pattern, each
    sample adds its own noise. Loss falls and accuracy rises, so a run shows learning without
    any download. Sample ``i`` is the same for every rank and every run with the same seed.
    """

    def __init__(self, size: int, shape: tuple, num_classes: int, seed: int, split: str):
        self.size, self.shape, self.num_classes = size, tuple(shape), num_classes
        g = torch.Generator().manual_seed(seed)
        coarse = torch.rand(num_classes, shape[0], 4, 4, generator=g) * 2 - 1
        self.prototypes = F.interpolate(coarse, size=shape[1:], mode="bilinear",
                                        align_corners=False)
        self.base = (seed % 1_000_003) * 4_000_000_000 + (0 if split == "train" else 2**31)
        self.targets = [i % num_classes for i in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        label = index % self.num_classes
        g = torch.Generator().manual_seed(self.base + index)
        noise = torch.randn(self.shape, generator=g)
        return self.prototypes[label] + noise, label


def synthetic_shape(model_name: str) -> tuple:
    """Synthetic data is shaped for the model: (input shape, number of classes)."""
    if model_name == "cnn":
        return (3, 32, 32), 10
    if model_name == "mnist_net":
        return (1, 28, 28), 10
    return (3, 64, 64), 200


def build_data(args, is_main: bool) -> DataBundle:
    """Train and val datasets for ``args.dataset``. Downloads (CIFAR-10, MNIST) run on rank 0
    first; call after the process group exists."""
    from torchvision import transforms as T
    if args.dataset == "synthetic":
        shape, classes = synthetic_shape(args.model)
        n_val = max(1, args.synthetic_size // 4)
        return DataBundle(
            SyntheticImages(args.synthetic_size, shape, classes, args.seed, "train"),
            SyntheticImages(n_val, shape, classes, args.seed, "val"), classes, shape,
            "synthetic", f"synthetic (built-in, learnable; no dataset read): "
                         f"{args.synthetic_size} train / {n_val} val, {classes} classes, "
                         f"{'x'.join(map(str, shape))}")
    if args.dataset == "tinyimagenet":
        if not args.data_dir:
            raise UsageError("--dataset tinyimagenet needs --data-dir (or $DATA_DIR) pointing "
                             "at the tiny-imagenet-200 folder")
        classes, train, val = scan_tinyimagenet(args.data_dir)
        if args.data_cache:
            return _cached_tinyimagenet(args, classes, train, val)
        norm = T.Normalize(*NORMALIZE["tinyimagenet"])
        train_tf = T.Compose([T.RandomCrop(64, padding=4), T.RandomHorizontalFlip(),
                              T.ToTensor(), norm])
        val_tf = T.Compose([T.ToTensor(), norm])
        return DataBundle(ImageList(train, train_tf, args.strict),
                          ImageList(val, val_tf, args.strict), len(classes),
                          (3, 64, 64), "tinyimagenet",
                          f"TinyImageNet at {args.data_dir}: {len(train)} train / {len(val)} "
                          f"val, {len(classes)} classes")
    return _torchvision_data(args, is_main)


def _torchvision_data(args, is_main: bool) -> DataBundle:
    from torchvision import datasets, transforms as T
    root = Path(args.data_dir or "data")
    mean, std = NORMALIZE[args.dataset]
    if args.dataset == "cifar10":
        cls, shape, archive = datasets.CIFAR10, (3, 32, 32), "cifar-10-python.tar.gz"
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                              T.ToTensor(), T.Normalize(mean, std)])
    else:
        cls, shape, archive = datasets.MNIST, (1, 28, 28), "MNIST/raw/*-ubyte.gz"
        train_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    val_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])

    def load(download: bool):
        try:
            return (cls(str(root), train=True, transform=train_tf, download=download),
                    cls(str(root), train=False, transform=val_tf, download=download))
        except (OSError, RuntimeError) as exc:  # URLError is an OSError
            raise UsageError(f"could not load {args.dataset} from {root} ({exc.__class__.__name__}"
                             f": {str(exc)[:120]}); without network, put {archive} (from the "
                             f"official site) in {root.resolve()} and pass --data-dir "
                             f"{root}") from None

    # rank 0 downloads (once per shared file system), the others read what it wrote
    train, val = rank0_first(lambda: load(download=is_main))
    return DataBundle(train, val, 10, shape, args.dataset,
                      f"{args.dataset} at {root}: {len(train)} train / {len(val)} val, 10 classes")


def real_samples(sampler) -> int:
    """How many of this rank's validation indices are real. A DistributedSampler without
    shuffle pads the stream by repeating the first samples so every rank gets the same count;
    rank r's real samples are r, r + world, r + 2*world, ... and come before its padding."""
    return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))


# --------------------------------------------------------------------------------------------
# Data, fast input: the decoded uint8 cache (--data-cache), batch loading, on-device augmentation
# --------------------------------------------------------------------------------------------

class CachedSplit(Dataset):
    """A split decoded once into a memory-mapped uint8 array (N x 64 x 64 x 3) plus labels.

    Indexed with a whole batch of indices (the DataLoader gets a BatchSampler), so one numpy
    fancy-index read replaces a JPEG decode and a PIL transform per image.
    """

    def __init__(self, images_file, labels_file):
        self.images = np.load(images_file, mmap_mode="r")
        self.labels = torch.from_numpy(np.load(labels_file))
        self.targets = self.labels.tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.ascontiguousarray(self.images[idx])), self.labels[idx]


def _cached_tinyimagenet(args, classes, train, val) -> DataBundle:
    """The memory-mapped cache that prepare_tinyimagenet.py writes. Where it is missing or
    stale, local rank 0 of each node builds it (the others wait in the all_gather below)."""
    import prepare_tinyimagenet
    error = None
    if dist_env().local_rank == 0:  # one builder per node
        try:
            prepare_tinyimagenet.prepare(args.data_dir, args.data_cache, args.strict,
                                         max(1, args.num_workers),
                                         lambda m: print(m, flush=True),
                                         scanned=(classes, train, val))
        except UsageError as exc:
            error = str(exc)
    if dist.is_available() and dist.is_initialized():
        # every rank: wait until each node's builder is done, and learn about its failure
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error)
        error = next((e for e in everyone if e), None)
    if error:
        raise UsageError(error)
    directory = prepare_tinyimagenet.cache_dir(args.data_dir, args.data_cache)
    train_set = CachedSplit(directory / "train_u8.npy", directory / "train_labels.npy")
    val_set = CachedSplit(directory / "val_u8.npy", directory / "val_labels.npy")
    return DataBundle(train_set, val_set, len(classes), (3, 64, 64), "tinyimagenet",
                      f"TinyImageNet at {args.data_dir} via the uint8 cache {directory}: "
                      f"{len(train_set)} train / {len(val_set)} val, {len(classes)} classes",
                      DeviceAugment(*NORMALIZE["tinyimagenet"]))


class DeviceAugment:
    """What the folder path does per image with PIL, done per batch on the device: uint8 NHWC
    -> (train) random crop with 4 pixels of zero padding and a random horizontal flip -> float
    in [0, 1] -> normalize. Without augmentation the NCHW result keeps the NHWC memory
    (channels_last)."""

    def __init__(self, mean, std):
        self.mean_std = (mean, std)
        self._cache = {}

    def _stats(self, device):
        if device not in self._cache:  # made once per device: no copy in the training step
            mean, std = self.mean_std
            self._cache[device] = (torch.tensor(mean, device=device).view(1, -1, 1, 1),
                                   torch.tensor(std, device=device).view(1, -1, 1, 1))
        return self._cache[device]

    def __call__(self, images: torch.Tensor, train: bool) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2)  # uint8 NCHW view: crop and flip 1-byte pixels
        if train:
            b, c, h, w = x.shape
            pad = 4
            x = F.pad(x, (pad, pad, pad, pad))  # zeros, like RandomCrop(padding=4) on the PIL image
            dy = torch.randint(0, 2 * pad + 1, (b, 1, 1, 1), device=x.device)
            dx = torch.randint(0, 2 * pad + 1, (b, 1, 1, 1), device=x.device)
            flip = torch.rand(b, 1, 1, 1, device=x.device) < 0.5
            rows = torch.arange(h, device=x.device).view(1, 1, h, 1) + dy
            x = x.gather(2, rows.expand(b, c, h, w + 2 * pad))  # crop rows
            cols = torch.arange(w, device=x.device).view(1, 1, 1, w)
            cols = torch.where(flip, w - 1 - cols, cols) + dx  # a flip is reversed columns
            x = x.gather(3, cols.expand(b, c, h, w))  # crop (and flip) columns
        x = x.float().div_(255)
        mean, std = self._stats(x.device)
        return (x - mean) / std


def make_loader(dataset, sampler, batch_size: int, args, device, drop_last: bool = False,
                start_now: bool = False, val: bool = False):
    """The DataLoader, tuned the same way for every strategy: pinned memory on CUDA,
    persistent workers and a deeper prefetch. A cached split is read a batch at a time.
    ``val``: each batch also says which of its positions survived (collate_val), which
    evaluate() needs to count every validation image exactly once.

    ``start_now`` forks the workers at once (for the validation loader). Forked later, at the
    first evaluation, a worker would share the trained model's memory copy-on-write, and the
    next training step would pay to copy every page it writes (0.3-0.65 s per run for ResNet-18
    on a 2-core CPU). The batches it prefetches now are dropped when evaluation starts."""
    from torch.utils.data import BatchSampler, DataLoader
    if args.data_on_device:
        return DeviceResident(dataset, sampler, batch_size, drop_last, device)
    kw = dict(num_workers=args.num_workers, pin_memory=device.type == "cuda",
              worker_init_fn=ignore_stop_signals,
              persistent_workers=args.num_workers > 0)
    if args.num_workers > 0:
        kw["prefetch_factor"] = 4
    if isinstance(dataset, CachedSplit):
        loader = DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last),
                            batch_size=None, **kw)
    else:
        loader = DataLoader(dataset, sampler=sampler, batch_size=batch_size,
                            drop_last=drop_last,
                            collate_fn=collate_val if val else collate_skip_unreadable, **kw)
    if start_now and args.num_workers > 0:
        iter(loader)  # persistent: the iterator and its workers stay for later epochs
    return loader


class DeviceResident:
    """--data-on-device: a whole split as two tensors on the device; each epoch's batches are
    slices of the sampler's order, indexed there (one host-to-device copy of the order per
    epoch, none per step). Iterates like the DataLoader it replaces."""

    def __init__(self, dataset, sampler, batch_size: int, drop_last: bool, device):
        if isinstance(dataset, CachedSplit):
            images, labels = torch.from_numpy(np.array(dataset.images)), dataset.labels
        else:  # SyntheticImages: the samples, made once
            images = torch.stack([dataset[i][0] for i in range(len(dataset))])
            labels = torch.as_tensor(dataset.targets)
        self.images, self.labels = images.to(device), labels.to(device)
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        order = torch.as_tensor(list(self.sampler), dtype=torch.int64).to(self.images.device)
        for k in range(len(self)):
            idx = order[k * self.batch_size:(k + 1) * self.batch_size]
            yield self.images[idx], self.labels[idx]


def to_device(batches, device: torch.device):
    """Yield (images, labels) from ``batches`` on ``device``. On CUDA the next batch is copied
    on a side stream while the current step computes (pinned memory, one batch ahead), so
    the copy is off the critical path; elsewhere this is a plain ``.to``."""
    it = iter(batches)
    if device.type != "cuda":
        for images, labels in it:
            yield images.to(device), labels.to(device)
        return
    copy_stream = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)

    def fetch():
        batch = next(it, None)
        if batch is not None:
            with torch.cuda.stream(copy_stream):
                batch = [t.to(device, non_blocking=True) for t in batch]
        return batch

    ahead = fetch()
    while ahead is not None:
        compute.wait_stream(copy_stream)  # this batch's copy is done before the step uses it
        for t in ahead:
            t.record_stream(compute)  # its memory is not reused while the step runs
        current, ahead = ahead, fetch()  # start the next copy, then hand out this batch
        yield current


def input_pipeline(data: DataBundle, model: nn.Module, device: torch.device):
    """(model, prepare): on CUDA, conv nets go channels_last (faster convolutions with AMP);
    ``prepare(images, train)`` finishes a batch on the device (cache-path augmentation, memory
    format). Called by every strategy so their inputs are identical."""
    channels_last = device.type == "cuda" and any(isinstance(m, nn.Conv2d)
                                                  for m in model.modules())
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    augment = data.device_augment
    layout = torch.channels_last if channels_last else torch.contiguous_format

    def prepare(images, train: bool):
        if augment is not None:
            images = augment(images, train)
        return images.contiguous(memory_format=layout)  # no-op when already in that layout
    return model, prepare


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

class CifarCNN(nn.Module):
    """The small CIFAR-10 CNN. No BatchNorm and no dropout: a step depends only on the batch,
    so runs are exactly comparable across world sizes."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 256),
                                        nn.ReLU(inplace=True), nn.Linear(256, num_classes))

    def forward(self, x):
        # x.shape[1:], not x.shape: the batch dimension differs per rank and per last batch
        assert x.shape[1:] == (3, 32, 32), f"cnn expects 3x32x32 images, got {tuple(x.shape[1:])}"
        return self.classifier(self.features(x))


class MnistNet(nn.Module):
    """The MNIST net of the workshop (two convolutions, dropout, two linear layers)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        assert x.shape[1:] == (1, 28, 28), f"mnist_net expects 1x28x28, got {tuple(x.shape[1:])}"
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        return self.fc2(self.dropout2(F.relu(self.fc1(x))))  # logits for CrossEntropyLoss


def check_model(name: str, shape: tuple) -> None:
    """Reject a model that cannot take the dataset's images, naming a model that can."""
    shown = "x".join(map(str, shape))
    if name == "cnn" and tuple(shape) != (3, 32, 32):
        raise UsageError(f"--model cnn takes 3x32x32 images (cifar10 or synthetic), not "
                         f"{shown}: choose --model resnet50")
    if name == "mnist_net" and tuple(shape) != (1, 28, 28):
        raise UsageError(f"--model mnist_net takes 1x28x28 images (mnist or synthetic), not "
                         f"{shown}: choose another --model")
    if name in ("cnn", "mnist_net"):
        return
    from torchvision import models
    if name not in models.list_models(module=models):
        raise UsageError(f"unknown --model {name!r}: use resnet50, cnn, mnist_net or a "
                         f"torchvision classification model such as resnet18 or "
                         f"mobilenet_v3_small")
    if shape[0] != 3:
        raise UsageError(f"--model {name} takes 3-channel images and this dataset has "
                         f"{shape[0]}: use --model mnist_net for MNIST")


def build_model(name: str, num_classes: int, input_shape: tuple) -> nn.Module:
    """A fresh model; the caller seeds torch first so every rank builds the same weights."""
    check_model(name, input_shape)
    if name == "cnn":
        return CifarCNN(num_classes)
    if name == "mnist_net":
        return MnistNet(num_classes)
    from torchvision import models
    return models.get_model(name, weights=None, num_classes=num_classes)


# --------------------------------------------------------------------------------------------
# Evaluation, memory, timing, provenance
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, loader, device, dtype, n_real: int, prepare=None) -> torch.Tensor:
    """Local validation sums [loss_sum, correct, count] on ``device`` (no host sync here).

    Only samples at the first ``n_real`` positions of this rank's stream are counted, so
    padding added by the DistributedSampler is never counted twice. The folder path's batches
    carry a third item, which positions survived (see collate_val): an unreadable image
    dropped from a batch must not shift a padding duplicate into the counted positions. Every
    rank runs the same number of batches, which FSDP needs (each forward all-gathers
    parameters with every rank).
    """
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    seen = 0  # positions of the sampler's stream consumed so far
    for images, labels, *mask in loader:
        # the cache path and DeviceResident drop nothing: every position survived
        survived = mask[0] if mask else torch.ones(labels.size(0), dtype=torch.bool)
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if prepare is not None:
            images = prepare(images, train=False)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(images)
        # Survivors keep the sampler's order, so those at real positions come first: count
        # them and keep that prefix (host-side count, no sync)
        keep = int(survived[:max(0, n_real - seen)].sum())
        seen += survived.numel()
        if keep:
            logits, labels = logits[:keep].float(), labels[:keep]
            sums[0] += F.cross_entropy(logits, labels, reduction="sum")
            sums[1] += (logits.argmax(1) == labels).sum()
            sums[2] += keep
    return sums


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak (at each epoch's start, so each epoch reports its own): the CUDA
    allocator's peak on a GPU, the process's peak resident set size on a CPU (Linux: writing 5
    to /proc/self/clear_refs resets VmHWM; elsewhere the peak stays the whole run's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process since the last ``reset_peak_memory``: CUDA
    ``max_memory_allocated`` on a GPU, else the peak resident set size (what the OS had to give
    the process: VmHWM, or getrusage's whole-run figure where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so the clock measures work done, not work queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now() -> float:
    return time.perf_counter()


def provenance(args, env: DistEnv, device: torch.device, backend: str) -> list:
    """Lines logged once at start by rank 0: versions, devices, layout, resolved arguments."""
    import torchvision
    cuda = torch.version.cuda or "n/a"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "n/a"
    if device.type == "cuda":
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    else:
        names = f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    args_text = " ".join(f"{k}={v}" for k, v in sorted(vars(args).items()))
    return [
        f"torch {torch.__version__} | torchvision {torchvision.__version__} | CUDA {cuda} | "
        f"NCCL {nccl} | python {platform.python_version()} | host {platform.node()}",
        f"devices: {names}",
        f"layout: world_size={env.world_size} nodes={env.nodes} "
        f"processes_per_node={env.local_world_size} backend={backend} device={device.type} "
        f"(ranks from {env.source})",
        f"mixed precision: {AMP_TEXT[args.amp]} (--amp {args.amp}; default: bf16 on GPUs of "
        f"compute capability 8.0+, fp16 on older GPUs, off on CPU)",
        f"args: {args_text}",
    ]


def check_writable(path) -> None:
    """Fail before training, not after it, when --save-model cannot be written."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise UsageError(f"cannot write --save-model {path}: {probe} is not writable; choose "
                         f"another path")
    if shutil.disk_usage(probe).free < 50 * 2**20:
        raise UsageError(f"less than 50 MiB free under {probe} for --save-model: free space "
                         f"or choose another path")


# --------------------------------------------------------------------------------------------
# Fault tolerance: checkpoints, resume, stop requests, preflight, collective check
# --------------------------------------------------------------------------------------------

CHECKPOINT_RE = r"^ckpt-e(\d+)-s(\d+)(\.pt)?$"


def checkpoint_name(epoch: int, step: int) -> str:
    """Name of the checkpoint taken after ``step`` steps of epoch index ``epoch`` (0-based);
    the end of epoch e is (e + 1, 0). Zero-padded, so names sort in training order."""
    return f"ckpt-e{epoch:04d}-s{step:07d}"


def list_checkpoints(directory) -> list:
    """Complete checkpoints in ``directory``, newest first. Temporary files and folders of an
    interrupted save never match (they are renamed into place only once complete)."""
    if not directory or not Path(directory).is_dir():
        return []
    found = []
    for p in Path(directory).iterdir():
        m = re.match(CHECKPOINT_RE, p.name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2))), p))
    return [p for _, p in sorted(found, reverse=True)]


def prune_checkpoints(directory, keep: int) -> None:
    for old in list_checkpoints(directory)[keep:]:
        _remove(old)


def _remove(path: Path) -> None:
    """Delete a checkpoint file or DCP folder; nothing when it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_checkpoint(tmp: Path, path: Path) -> None:
    """Move a complete checkpoint, file or DCP folder, from ``tmp`` to ``path``, replacing
    whatever is there. A folder cannot be renamed over a non-empty folder, so the old one is
    first renamed aside to ``.old-<name>``, the new one renamed in, then the old one deleted:
    a crash at any point leaves the old or the new checkpoint, and ``tidy_checkpoint_dir``
    renames a lone ``.old-<name>`` back at the next start."""
    aside = path.with_name(f".old-{path.name}")
    if path.exists() or path.is_symlink():
        _remove(aside)
        os.replace(path, aside)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _remove(aside)


def tidy_checkpoint_dir(directory) -> None:
    """At start, before anything is listed: finish a replacement a crash interrupted (a lone
    ``.old-<name>`` becomes ``<name>`` again) and delete what interrupted saves left behind
    (``.tmp-*`` files and folders, a superseded ``.old-*``). Only the run holding the
    directory's lock calls this, so no live save is touched."""
    if not directory or not Path(directory).is_dir():
        return
    for p in sorted(Path(directory).iterdir()):
        if p.name.startswith(".old-"):
            original = p.with_name(p.name[len(".old-"):])
            if original.exists():
                _remove(p)
            else:
                os.replace(p, original)
        elif p.name.startswith(".tmp-"):
            _remove(p)


#: The lock file of a checkpoint dir: "<host> <pid>" of the run that writes there.
LOCK_FILE = ".lock"
LOCK_REFRESH_S = 10  # the holder touches the lock this often ...
LOCK_STALE_S = 60    # ... so one untouched this long belongs to a run that is gone
_held_lock: Path | None = None


def _lock_holder(path: Path) -> tuple:
    """(who, alive) for an existing lock: alive while it is refreshed and, on this host, its
    process exists (a killed holder's lock is taken over at once, another host's after
    LOCK_STALE_S)."""
    try:
        text = path.read_text(errors="replace").strip()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "", False
    host, _, pid = text.partition(" ")
    alive = age < LOCK_STALE_S
    if alive and host == platform.node() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            pass  # exists, another user's
    return f"host {host or '?'}, pid {pid or '?'}", alive


def lock_checkpoint_dir(directory) -> None:
    """Claim ``directory`` for this run (rank 0 calls it), so that two runs never write and
    resume from the same checkpoints: one whose predecessor still runs (an orphaned worker, a
    job started twice) stops here. A thread refreshes the lock; end_process removes it."""
    global _held_lock
    path = Path(directory) / LOCK_FILE
    me = f"{platform.node()} {os.getpid()}"
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            who, alive = _lock_holder(path)
            if alive:
                raise UsageError(f"--checkpoint-dir {directory} is in use by another run "
                                 f"({who}): wait for it to end or stop it, or choose another "
                                 f"--checkpoint-dir") from None
            if who:
                print(f"note: taking over the lock of {directory} from a run that is gone "
                      f"({who})", flush=True)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        _held_lock = path
        threading.Thread(target=_refresh_lock, args=(path, me), daemon=True).start()
        return
    raise UsageError(f"could not lock --checkpoint-dir {directory}: another run keeps taking "
                     f"it; choose another --checkpoint-dir")


def _refresh_lock(path: Path, me: str) -> None:
    while _held_lock == path:
        try:
            if path.read_text().strip() != me:
                return  # taken over (this process was stopped for minutes): stop touching it
            os.utime(path)
        except FileNotFoundError:
            return
        except OSError:
            pass  # a passing file-system error (NFS): try again at the next refresh
        time.sleep(LOCK_REFRESH_S)


def release_checkpoint_lock() -> None:
    global _held_lock
    path, _held_lock = _held_lock, None
    try:
        if path is not None and path.read_text().strip().partition(" ")[2] == str(os.getpid()):
            path.unlink()
    except OSError:
        pass


def claim_checkpoint_dir(directory) -> None:
    """Every rank, before resuming: rank 0 takes the lock and tidies what a crash left."""
    if directory:
        on_rank0(lambda: (lock_checkpoint_dir(directory), tidy_checkpoint_dir(directory)))


def atomic_save(obj, path) -> None:
    """torch.save to a temporary file, fsync, rename: a crash leaves the old file or the new
    one, never half a file under the final name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    replace_checkpoint(tmp, path)


def save_state_dict(state: dict, path) -> None:
    """--save-model: the bare state_dict, written atomically."""
    atomic_save(state, path)


def resume_candidates(args) -> list:
    """Checkpoints to try, newest first: [] for a fresh start."""
    if args.resume == "never":
        return []
    if args.resume != "auto":
        return [Path(args.resume)]
    return list_checkpoints(args.checkpoint_dir)


def load_newest(candidates: list, load_one):
    """Return ``load_one(path)`` for the newest candidate that loads, warning about each one
    that does not. Checkpoints exist but none loads: a UsageError, never a silent fresh start."""
    for path in candidates:
        try:
            return load_one(path)
        except (UsageError, KeyboardInterrupt, SystemExit):
            raise
        # BaseException: DCP's CheckpointException (a truncated shard) derives from it
        except BaseException as exc:  # truncated zip, bad pickle, missing DCP shard, ...
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            print0(f"warning: checkpoint {path} is unusable ({exc.__class__.__name__}: "
                   f"{first}); trying the previous one")
    if candidates:
        raise UsageError(f"none of the {len(candidates)} checkpoint(s) in "
                         f"{candidates[0].parent} could be loaded: move them away and pass "
                         f"--resume never to start fresh, or point --resume at a good one")
    return None


def rng_state() -> dict:
    """This process's random state (torch CPU and current CUDA device, Python)."""
    import random
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class SkipFirst(torch.utils.data.Sampler):
    """Wrap a (Distributed)Sampler and skip the first ``skip`` indices of the next epoch, so a
    run resumed mid-epoch does not see the batches it already trained on."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        import itertools
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.skip)


class StopRequest:
    """SIGUSR1 (Slurm's warning before the time limit) or SIGTERM (preemption) asks the run to
    checkpoint at the next step boundary and exit with REQUEUE_EXIT. The signals are caught
    from the start (catch_stop_signals); a USR1 that came during start-up counts here.

    Ranks receive the signal at slightly different times, or only some of them do, so they
    vote: every step each rank contributes the number of the signal it got (0: none) to an
    all-reduce (MAX) on a CPU (gloo) group, started without waiting; the result is read one
    step later, when it has long arrived. All ranks therefore stop after the same step, name
    the same signal, and no GPU sync is added to the step.
    """

    def __init__(self, world_size: int):
        self.signum = 0  # agreed by the vote
        self._buf = torch.zeros(1, dtype=torch.int32)
        self._work = None
        self._group = None
        if world_size > 1:  # a gloo group for the vote, whatever the training backend
            self._group = dist.new_group(backend="gloo")
        _Signals.training = True

    @property
    def signame(self) -> str:
        import signal
        return signal.Signals(self.signum).name if self.signum else "stop request"

    def report(self, epoch: int, step: int, saved: bool) -> str:
        """What rank 0 prints as the run stops: a sentence, then the [STOP] line for job.sh."""
        if saved:
            text = (f"{self.signame}: checkpoint saved at epoch {epoch}, step {step}; exiting "
                    f"with code {REQUEUE_EXIT} to be requeued")
        else:
            text = (f"{self.signame}: stopping without a checkpoint (no --checkpoint-dir); "
                    f"exiting with code {REQUEUE_EXIT}")
        return text + "\n" + STOP_LINE.format(signal=self.signame, epoch=epoch, step=step,
                                              saved=int(saved), code=REQUEUE_EXIT)

    def should_stop(self) -> bool:
        """Call once per step on every rank; True on all ranks at the same step."""
        if self._group is None:
            self.signum = _Signals.signum
            return bool(self.signum)
        if self._work is not None:
            self._work.wait()
            self.signum = int(self._buf.item())
        agreed = bool(self.signum)
        self._buf.fill_(_Signals.signum)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group,
                                     async_op=True)
        return agreed

    def finish(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class NonFiniteLoss(Exception):
    """The loss became NaN/inf in a way GradScaler does not absorb."""


def check_finite(bad_steps: torch.Tensor, first_bad: torch.Tensor, epoch: int, scaler) -> None:
    """Host sync, called only before a checkpoint and at the end of an epoch, on every rank.

    The ranks vote first (one all-reduce, every rank of the group): a NaN seen on rank 1 alone
    stops every rank here, with the same message, instead of rank 1 raising while the others
    wait in their next collective until --dist-timeout. With fp16, a few non-finite losses are
    overflows that GradScaler skips; it is fatal once the scale has collapsed below 1 (the
    overflow never goes away). Otherwise any non-finite loss is fatal."""
    never = torch.full_like(first_bad, -2**62)
    verdict = torch.stack([bad_steps, torch.where(first_bad >= 0, -first_bad, never)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # most bad steps; earliest bad step
    bad, neg_first = verdict.tolist()
    if bad == 0:
        return
    if scaler.is_enabled() and scaler.get_scale() >= 1.0:
        return
    raise NonFiniteLoss(f"the loss became NaN or inf at epoch {epoch + 1}, step "
                        f"{-neg_first + 1}; nothing was saved after the last good "
                        f"checkpoint: lower --lr or check the data, then resume from it")


def track_finite(loss, step: int, bad_steps, first_bad) -> None:
    """Device-side bookkeeping of non-finite losses: no host sync in the training step."""
    bad = ~torch.isfinite(loss.detach())
    bad_steps += bad.to(bad_steps.dtype)
    first_bad.copy_(torch.where(bad & (first_bad < 0), torch.full_like(first_bad, step),
                                first_bad))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Checkpoints:
    """What the training loop must do besides training, behind one object: resume from the
    newest usable checkpoint, checkpoint every --checkpoint-every steps and at each epoch end
    (pruned to --keep-checkpoints), watch for NaN/inf losses without a host sync per step,
    and stop at the same step on every rank after a stop signal. The loop calls resume() once,
    after_step() after every step, check_finite() and end_epoch() once per epoch.

    ``save(path, state, meta)`` and ``load(path, state) -> meta`` are the strategy's own:
    ``state`` holds the model, optimizer, scheduler and scaler (each has a state_dict),
    ``meta`` the plain values (epoch, step, metrics, the RNG state of every rank, args)."""

    def __init__(self, args, state: dict, save, load, device: torch.device, world_size: int):
        self.args, self.state, self._save, self._load = args, state, save, load
        self.dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
        self.metrics = {}  # the last finished epoch's (from the checkpoint, after a resume)
        self.stop = StopRequest(world_size)  # collective: every rank builds it
        self.bad_steps = torch.zeros((), device=device, dtype=torch.int64)  # NaN/inf losses,
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)  # on the device

    def resume(self) -> tuple:
        """(epoch, step) to start from, on every rank: (0, 0) for a fresh start."""
        claim_checkpoint_dir(self.dir)  # lock it; tidy an interrupted save
        meta = load_newest(resume_candidates(self.args),
                           lambda path: dict(self._load(path, self.state), path=path))
        if not meta:
            return 0, 0
        rngs = meta["rng"]
        set_rng_state(rngs[_rank()] if _rank() < len(rngs) else rngs[0])
        self.metrics = meta["metrics"]
        print0(f"Resumed from epoch {meta['epoch'] + 1}, step {meta['step']} ({meta['path']})")
        return meta["epoch"], meta["step"]

    def after_step(self, loss, epoch: int, done: int, steps: int) -> bool:
        """Every rank, after step ``done`` (1-based) of ``steps``: True when the run must end
        now (a stop signal; checkpointed first when there is a --checkpoint-dir)."""
        track_finite(loss, done - 1, self.bad_steps, self.first_bad)
        every = self.args.checkpoint_every
        if self.dir and every and done % every == 0 and done < steps:
            self.check_finite(epoch)  # never save weights that a NaN has reached
            self.save(epoch, done)
        if not self.stop.should_stop():  # all ranks agree on the same step
            return False
        if self.dir:
            self.check_finite(epoch)
            self.save(epoch, done)
        print0(self.stop.report(epoch + 1, done, saved=self.dir is not None))
        return True

    def check_finite(self, epoch: int) -> None:
        """A host sync and a vote (every rank): raises NonFiniteLoss after a NaN/inf loss."""
        check_finite(self.bad_steps, self.first_bad, epoch, self.state["scaler"])
        self.bad_steps.zero_()
        self.first_bad.fill_(-1)

    def end_epoch(self, epoch: int, metrics: dict) -> None:
        """After the epoch's check_finite() and metrics: the epoch-end checkpoint."""
        self.metrics = metrics
        if self.dir:
            self.save(epoch + 1, 0)

    def save(self, epoch: int, step: int) -> None:
        """Collective: every rank takes part (their RNG states are gathered into the file).
        The caller has just run check_finite()."""
        rngs = [rng_state()]
        if dist.is_available() and dist.is_initialized():
            rngs = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, rng_state())
        meta = dict(epoch=epoch, step=step, metrics=self.metrics, rng=rngs,
                    args=vars(self.args), world_size=len(rngs))
        self._save(self.dir / checkpoint_name(epoch, step), self.state, meta)
        if _rank() == 0:
            prune_checkpoints(self.dir, self.args.keep_checkpoints)

    def finish(self) -> None:
        self.stop.finish()


def check_checkpoint_dir(directory, model) -> None:
    """Preflight: the checkpoint dir is writable and has room for a few checkpoints."""
    if directory is None:
        return
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create --checkpoint-dir {path} ({exc.strerror}): choose a "
                         f"writable folder") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--checkpoint-dir {path} is not writable: choose another folder")
    per_ckpt = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # +momentum
    need = per_ckpt * 3
    free = shutil.disk_usage(path).free
    if free < need:
        raise UsageError(f"--checkpoint-dir {path} has {free / 2**20:.0f} MiB free but "
                         f"checkpoints need about {need / 2**20:.0f} MiB: free space or choose "
                         f"another folder")


def collective_check(device: torch.device, world: int, print0) -> None:
    """--check: an all-reduce with a known answer, then its bandwidth (as nccl-tests reports
    it: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n). Every rank takes part."""
    rank = dist.get_rank()
    probe = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    expected = world * (world + 1) / 2
    got = probe[0].item()
    if got != expected:
        raise RuntimeError(f"all-reduce returned {got}, expected {expected}: the collective "
                           f"backend is broken between these ranks")
    mib = 64 if device.type == "cuda" else 16
    data = torch.ones(mib * 2**20 // 4, device=device)
    for _ in range(2):  # warm-up: connections, buffers
        dist.all_reduce(data)
    synchronize(device)
    iters = 5
    t0 = now()
    for _ in range(iters):
        dist.all_reduce(data)
    synchronize(device)
    seconds = (now() - t0) / iters
    algbw = mib * 2**20 / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world if world > 1 else 0.0
    print0(f"check: all-reduce OK across {world} rank(s) (sum {got:g} == {expected:g}); "
           f"{mib} MiB in {seconds * 1e3:.2f} ms: algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s")
