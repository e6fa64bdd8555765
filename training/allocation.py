"""The launch checked against what Slurm gave the job, at start and before any collective.

A launch that does not fit its allocation fails late and far from its cause: more processes on
a node than GPUs put two ranks on one GPU (NCCL refuses it, or the run crawls); a task that got
one CPU where `#SBATCH --cpus-per-task` asked for sixteen (srun of Slurm 22.05 to 23.02 no
longer passes it on) starves its loader workers; a fixed MASTER_PORT collides with another job
on the same node. ``check_launch`` says each of these in one sentence that names the `#SBATCH`
line (or the export) to change: an impossible launch is a UsageError (exit 2), a starving one a
warning. Outside Slurm it says nothing: there is no allocation to hold the launch against.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from training.distributed import DistEnv
from training.faults import UsageError


def derived_port(job_id: str) -> int:
    """The rendezvous port of a Slurm job: the same rule as launch/job.sh and dist_env's srun
    fallback, so two jobs on one node take different ports."""
    return 20000 + int(job_id) % 20000


def job_ports(job_id: str) -> list:
    """The rendezvous ports launch/job.sh may give a Slurm job: derived_port, else (another
    process holds it) the first free one of 10000 + (job + k * 1009) % 10000, k = 0 to 48."""
    return [derived_port(job_id)] + [10000 + (int(job_id) + k * 1009) % 10000
                                     for k in range(49)]


def _int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _affinity() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cpus() -> int:
    """The CPUs this task's processes and their loader workers can use: those it may run on,
    and no more than `#SBATCH --cpus-per-task` asked for, where it asked (srun of Slurm 22.05
    to 23.02 can give a task fewer than asked, problems() says when). flags.default_workers
    sizes the loader workers by it, problems() checks --num-workers against it."""
    cpus, asked = _affinity(), _int("SLURM_CPUS_PER_TASK")
    return min(cpus, asked) if asked else cpus


def _visible_devices() -> list | None:
    """The CUDA_VISIBLE_DEVICES list, or None when it is unset."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return None
    return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]


def other_jobs_on(node: str, job_id: str) -> list:
    """The ids of the other running jobs on ``node`` (squeue; none when it cannot answer)."""
    try:
        out = subprocess.run(["squeue", "-h", "-t", "R", "-w", node, "-o", "%A"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({j for j in out.split() if j.isdigit() and j != job_id}, key=int)


def rendezvous_port(env: DistEnv) -> tuple:
    """(what names it, the port) where this job's ranks meet, or ("", "") when it cannot be
    seen. srun's tasks and torchrun's static rendezvous (--master-port) meet on MASTER_PORT.
    torchrun's c10d rendezvous meets on its --rdzv-endpoint, which launch/job.sh exports as
    RDZV_ENDPOINT; the MASTER_PORT it hands its workers is a free port it picked itself."""
    if env.source != "torchrun" or os.environ.get("TORCHELASTIC_RUN_ID") == "none":
        return "MASTER_PORT", os.environ.get("MASTER_PORT", "")
    endpoint = os.environ.get("RDZV_ENDPOINT", "")
    if ":" in endpoint:
        return "the rendezvous port of RDZV_ENDPOINT", endpoint.rsplit(":", 1)[1]
    return "", ""


def problems(env: DistEnv, device: str, share_gpus: bool, workers: int) -> tuple:
    """(the error, or None; the warnings) of this launch against this node's allocation.

    ``env``: this process's place (its local world: the processes on this node); ``device``:
    --device; ``workers``: the loader workers each process will start."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return None, []
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    procs = max(1, env.local_world_size)
    warnings = []

    # GPUs: what Slurm gave the node against the processes started on it.
    visible = _visible_devices()
    on_node = _int("SLURM_GPUS_ON_NODE") or (len(visible) if visible else 0)
    said_by = "SLURM_GPUS_ON_NODE" if _int("SLURM_GPUS_ON_NODE") else "CUDA_VISIBLE_DEVICES"
    own_gpu_tasks = env.source == "slurm" and visible is not None and len(visible) == 1
    hidden = visible is not None and visible in ([], ["-1"])  # no GPU, on purpose
    if device != "cpu" and on_node and not share_gpus and not hidden:
        if procs > on_node:
            how = (f"ask for {on_node} task(s) per node with `#SBATCH "
                   f"--ntasks-per-node={on_node}`" if env.source == "slurm" else
                   f"start {on_node} process(es) per node (NPROC_PER_NODE={on_node} for "
                   f"launch/job.sh, torchrun --nproc-per-node={on_node})")
            return (f"{procs} processes were started on {node}, but Slurm gave it {on_node} "
                    f"GPU(s) ({said_by}), so ranks would share a GPU: change "
                    f"`#SBATCH --gpus-per-node={procs}`, or {how}, or add --share-gpus "
                    f"to share them on purpose"), []
        if visible is not None and len(visible) < procs and not own_gpu_tasks:
            return (f"{procs} processes on {node} see only CUDA_VISIBLE_DEVICES="
                    f"{','.join(visible)}, fewer GPUs than processes: "
                    f"`#SBATCH --gpus-per-task` hides the task's other GPUs from torchrun's "
                    f"workers; use `#SBATCH --gpus-per-node={procs}` instead"), []
        if visible and len(set(visible)) < len(visible):
            return (f"CUDA_VISIBLE_DEVICES={','.join(visible)} on {node} names a GPU twice, so "
                    f"two ranks would drive one GPU: let Slurm set it (`#SBATCH "
                    f"--gpus-per-node`), do not export it"), []

    # CPUs: what this task may really run on against what the job asked for and the workers.
    cpus, asked, usable = _affinity(), _int("SLURM_CPUS_PER_TASK"), usable_cpus()
    if asked and cpus < asked and "SRUN_CPUS_PER_TASK" not in os.environ:
        warnings.append(
            f"warning: this task on {node} may run on {cpus} CPU(s), but `#SBATCH "
            f"--cpus-per-task={asked}` asked for {asked}: srun of Slurm 22.05 to 23.02 no "
            f"longer passes it on to its tasks, so export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK "
            f"before srun (launch/job.sh does), or the loader workers starve")
    else:
        # torchrun starts the node's processes in one task: they share its CPUs.
        each = usable // procs if env.source == "torchrun" else usable
        if workers > 0 and each < workers + 1:
            per_task = (workers + 1) * (procs if env.source == "torchrun" else 1)
            line = f"`#SBATCH --cpus-per-task={asked}`" if asked else "no `#SBATCH --cpus-per-task`"
            if env.source == "torchrun" and procs > 1:
                line += f", shared by {procs} processes"
            warnings.append(
                f"warning: {workers} loader workers per process, but each process on {node} "
                f"has {each} CPU(s) (the task has {usable}, {line}), so the workers take "
                f"turns and starve the training: change it to `#SBATCH "
                f"--cpus-per-task={per_task}`, or lower --num-workers to {max(0, each - 1)}")

    # The port: a fixed one collides when another job on this node takes it too.
    name, port = rendezvous_port(env)
    if (env.world_size > 1 and env.local_rank == 0 and port
            and port not in map(str, job_ports(job))):
        others = other_jobs_on(node, job)
        if others:
            warnings.append(
                f"warning: {name}={port} is fixed, and job(s) {', '.join(others)} also run "
                f"on {node}: two jobs on one node that take the same port collide (address in "
                f"use, or a rank joins the other job's rendezvous); derive it from the job id, "
                f"export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) as launch/job.sh does, "
                f"or keep the node to this job with `#SBATCH --exclusive`")
    return None, warnings


def check_launch(env: DistEnv, device: str, share_gpus: bool, workers: int) -> None:
    """Every rank, first thing (common.run, before the process group): raise the launch's
    UsageError, or print its warnings once per node (local rank 0: the allocation is the
    node's)."""
    error, warnings = problems(env, device, share_gpus, workers)
    if error:
        raise UsageError(error)
    if env.local_rank == 0:
        for line in warnings:
            print(line, file=sys.stderr, flush=True)
