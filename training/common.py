"""What every training script does around its own lesson: ``run(train, parser)``, which each
script's main() calls (flags, rank layout, stop signals, watchdog, exit codes), a rank's device
and backend (``choose_device``), the evaluation pass (every validation sample counted exactly
once) and the provenance lines a run starts with.

dp_train.py, ddp_train.py and fsdp_train.py each keep inline what a strategy *is* (process
group, model wrapper, sampler, training step, saving) and a short loop around the step; the
loop's bookkeeping (progress, metrics and their reduction, checkpoint and stop calls) is
loop.py's. The flags are in flags.py; the rank layout, ``print0`` and the reduction over ranks
in distributed.py; the output lines and exit codes in contract.py; the models in models.py;
the datasets in datasets.py and the loaders that feed them to the loop in loading.py;
checkpoints in checkpoint.py; what happens when something goes wrong in faults.py; the stop
for a requeue in stopping.py; the NaN guard in lossguard.py; the learning-rate schedule in
schedule.py; what a run measures about itself beyond the metrics (progress, data wait, peak
memory) in measure.py, --profile's step breakdown in profiling.py and the collectives'
bandwidth in bandwidth.py. Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from training import (allocation, contract, ctrl_c, devices, distributed, hangs, network,
                      watchdog)
from training.distributed import DistEnv, dist_env, print0
from training.faults import (UsageError, collective_failed, crashed, exit_line, fail_cleanly,
                             is_collective_failure)
from training.flags import AMP_TEXT, check_flags, default_workers, misplaced_torchrun_flag
from training.lossguard import NonFiniteLoss
from training.stopping import Requeue, catch_stop_signals


def run(train, parser: argparse.ArgumentParser, argv=None) -> int:
    """What every training script does around its ``train(args, env)``, so each script keeps
    only the lesson: parse the flags; find the rank layout (torchrun, srun or one process);
    catch the stop signals from the start; start the watchdog; map what went wrong to an exit
    code (2: a problem the user can fix, contract.NONFINITE_EXIT: NaN loss,
    contract.REQUEUE_EXIT: stopped for a requeue after a checkpoint, 138 or 143: stopped with
    nothing saved, 1: a collective failed or any other error, after its traceback, 130:
    Ctrl-C); and, once every rank has finished, the last barrier and the process group's
    teardown. Returns the exit code for end_process."""
    ctrl_c.raises()  # from here a Ctrl-C is the one-line message below, not the end
    misplaced = misplaced_torchrun_flag(sys.argv[1:] if argv is None else argv, parser.prog)
    if misplaced:  # argparse would print its whole usage and "unrecognized arguments"
        print(f"error: {misplaced}", file=sys.stderr, flush=True)
        return exit_line(2)
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # argparse's error (2), or --help (0)
        return exit_line(done.code or 0)
    env = None
    try:
        env = dist_env()
        distributed.set_layout(env)  # who prints, until the process group answers it
        catch_stop_signals()  # from the start: a signal is never lost
        hangs.print_stacks_on_signal()  # kill -USR2: where this process is, and it goes on
        devices.check_versions(torch.__version__, devices.torchvision_version())  # the floor
        check_flags(args)  # before the watchdog and the process group use them
        if args.check or args.profile is not None:  # NCCL's transport, for [BANDWIDTH]
            network.capture_nccl_log()  # before the process group: NCCL reads it once
        if args.simulate_world_size:  # rank 0 of N, on the fake process group
            env = distributed.simulated(args.simulate_world_size, env)
            distributed.set_layout(env)
            distributed.set_print_prefix(f"simulation, rank 0 of {env.world_size}: ")
        # The launch against what Slurm gave the job, before any collective: one sentence
        # that names the #SBATCH line to change (launch/job.sh's runs and --check alike).
        workers = args.num_workers if args.num_workers is not None else default_workers(env)
        allocation.check_launch(env, args.device, args.share_gpus, workers)
        watchdog.start(env, args.dist_timeout)  # ends this worker if orphaned or frozen
        if env.world_size > 1 and env.source != "simulated":
            hangs.flight_recorder_env()  # NCCL keeps its last collectives, dumped on a timeout
        try:
            rc = train(args, env)
        except Requeue as stop:  # every rank, after the same step; checkpointed if it could
            print0(stop)
            # job.sh reads a requeue from the [STOP] line; any other code from [EXIT] (torchrun
            # reports a worker's 143 as 1)
            rc = stop.code if stop.code == contract.REQUEUE_EXIT else exit_line(stop.code, env)
        # Let every rank finish its last collective before any of them tears gloo or NCCL
        # down; without this barrier a process can abort at exit.
        if distributed.is_distributed():
            dist.barrier()
        hangs.forget()  # every rank got past the barrier: no hang to name
        return rc
    except UsageError as err:
        hangs.forget()  # no hang: the error's sentence says what ended the run
        return exit_line(fail_cleanly(err, env), env)
    except NonFiniteLoss as err:  # every rank raises it at the same check (a vote)
        hangs.forget()
        if env is None or env.rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return exit_line(contract.NONFINITE_EXIT, env)
    except Exception as err:  # noqa: BLE001 (a bug too must end the process, never hang)
        if is_collective_failure(err):  # a peer died or a collective timed out
            hangs.report()  # where each rank waits, read from every rank's record
            return collective_failed(err, env)
        return exit_line(crashed(err, env), env)
    except KeyboardInterrupt:  # Ctrl-C: one line, and end_process releases the checkpoint lock
        if env is None or env.rank == 0:
            print("error: interrupted (Ctrl-C); " + (
                "this run saves no checkpoint (no --checkpoint-dir), so a rerun starts over"
                if args.checkpoint_dir is None else
                "nothing was saved since the last checkpoint. To stop with a checkpoint, run "
                "the command of the start-up line 'stop with a checkpoint: ...' (SIGTERM to "
                "torchrun, never SIGUSR1), or under Slurm scancel --signal=USR1"),
                file=sys.stderr, flush=True)
        return 130
    finally:
        if distributed.is_distributed():
            dist.destroy_process_group()
        distributed.set_layout(None)  # the run is over: nobody is any rank any more


def choose_device(args, env: DistEnv) -> tuple:
    """(device, backend, shared) of one rank of a process group, chosen in one place for
    ddp_train.py and fsdp_train.py: with --device and a torch that can run on the GPU, this
    rank's GPU (made current before any CUDA work, so that NCCL binds the right one) and NCCL;
    ranks that share a GPU (--share-gpus, ``shared``) talk over gloo instead. Otherwise the
    CPU and gloo. (dp_train.py is one process over several GPUs: it chooses its own.)"""
    if not devices.use_gpu(args):
        return torch.device("cpu"), "gloo", False
    visible = torch.cuda.device_count()
    gpu = distributed.gpu_index(visible, env.local_rank, env.local_world_size, env.source,
                                args.share_gpus)
    device = torch.device("cuda", gpu)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels
    shared = distributed.sharing_gpus(visible, env, args.share_gpus)
    return device, "gloo" if shared else "nccl", shared


def print_start(args, env: DistEnv, device: torch.device, backend: str,
                on_cpu: str = "training on CPU with the gloo backend") -> None:
    """Rank 0's first lines: the provenance (versions, devices, layout, the resolved flags),
    and why a run trains on the CPU when it does (``on_cpu``: how)."""
    for line in provenance(args, env, device, backend):
        print0(line)
    if device.type == "cpu":
        why = "--device cpu" if args.device == "cpu" else "no GPU visible"
        print0(f"note: {why}: {on_cpu}")


@torch.no_grad()
def evaluate(model, loader, device, dtype, n_real: int, prepare=None) -> torch.Tensor:
    """Local validation sums [loss x n, correct, n] on ``device`` (no host sync here).

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


def provenance(args, env: DistEnv, device: torch.device, backend: str) -> list:
    """Lines logged once at start by rank 0: versions, devices, layout, resolved arguments."""
    if torch.cuda.is_available():
        cuda = (f"CUDA {torch.version.cuda} | NCCL "
                f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
    elif torch.version.cuda:  # what this torch was built for, not what the machine has
        cuda = f"CUDA build {torch.version.cuda} (no GPU)"
    else:
        cuda = "CPU-only build"
    if device.type == "cuda":
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    else:
        names = f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    args_text = " ".join(f"{k}={v}" for k, v in sorted(vars(args).items()))
    return [
        f"torch {torch.__version__} | torchvision {devices.torchvision_version()} | {cuda} | "
        f"python {platform.python_version()} | host {platform.node()}",
        f"devices: {names}",
        (f"layout: world_size={env.world_size} nodes={env.nodes} "
         f"processes_per_node={env.local_world_size} backend={backend} device={device.type} "
         f"(ranks from {env.source})" if env.source != "simulated" else
         f"layout: this one process as rank 0 of world_size={env.world_size} (simulated: "
         f"torch's fake process group, no collective runs) device={device.type}"),
        f"mixed precision: {AMP_TEXT[args.amp]} (--amp {args.amp}; default: bf16 on GPUs of "
        f"compute capability 8.0+, fp16 on older GPUs, off on CPU)",
        f"args: {args_text}",
    ] + stop_line(env, args.checkpoint_dir)


def stop_line(env: DistEnv, checkpoint_dir: str | None) -> list:
    """How to stop a run started by hand with a checkpoint, said at its start: the signal and
    the process that must get it. torchrun passes a SIGTERM on to its workers, while a SIGUSR1
    ends torchrun itself (it has no handler for it) and the work since the last checkpoint is
    lost. One rank that gets it is enough: the ranks vote and all stop at the same step.
    Without a --checkpoint-dir the same signal stops the run at a step and saves nothing, and
    the line says so. Under Slurm nothing: scancel and the launchers' traps do it
    (docs/fault-tolerance.md)."""
    if os.environ.get("SLURM_JOB_ID") or env.source == "simulated":
        return []
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun, this process's parent
        how = (f"kill -TERM {os.getppid()} (torchrun, which passes SIGTERM on to its workers; "
               f"SIGUSR1 would end torchrun itself)")
    else:
        how = f"kill -TERM {os.getpid()} (or -USR1)"
    if checkpoint_dir is None:
        return [f"stop: {how}; nothing is saved without --checkpoint-dir"]
    return [f"stop with a checkpoint: {how}"]
