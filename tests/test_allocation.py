"""The launch checked against the allocation (training/allocation.py), with a faked Slurm
environment and a faked os.sched_getaffinity; the real cluster's cases are in
tests/test_launchers.py (test_slurm_allocation_*)."""

from __future__ import annotations

import os

import pytest

from training import allocation, flags
from training.distributed import DistEnv
from training.faults import UsageError
from conftest import run_script

TORCHRUN_2 = DistEnv(0, 0, 2, 2, "torchrun", 1)  # one torchrun, two workers on one node


@pytest.fixture
def slurm(monkeypatch):
    """A Slurm job 4242 on node n1 with nothing else set; returns a setter for more."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SRUN_")) or name in (
                "CUDA_VISIBLE_DEVICES", "MASTER_PORT", "RDZV_ENDPOINT", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setattr(allocation, "other_jobs_on", lambda node, job: [])

    def given(cpus: int = 16, **env):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
    return given


def test_outside_slurm_nothing_is_checked(slurm, monkeypatch):
    slurm(cpus=1, SLURM_GPUS_ON_NODE=1)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert allocation.problems(TORCHRUN_2, "auto", False, 8) == (None, [])


def test_a_launch_that_fits_says_nothing(slurm):
    slurm(cpus=16, SLURM_GPUS_ON_NODE=2, CUDA_VISIBLE_DEVICES="0,1", SLURM_CPUS_PER_TASK=16,
          SRUN_CPUS_PER_TASK=16, MASTER_PORT=allocation.derived_port("4242"))
    assert allocation.problems(TORCHRUN_2, "auto", False, 7) == (None, [])


def test_more_processes_than_gpus_names_the_sbatch_line(slurm):
    slurm(SLURM_GPUS_ON_NODE=1, CUDA_VISIBLE_DEVICES="0")
    error, _ = allocation.problems(TORCHRUN_2, "auto", False, 0)
    assert error == ("2 processes were started on n1, but Slurm gave it 1 GPU(s) "
                     "(SLURM_GPUS_ON_NODE), so ranks would share a GPU: change `#SBATCH "
                     "--gpus-per-node=2`, or start 1 process(es) per node (NPROC_PER_NODE=1 "
                     "for launch/job.sh, torchrun --nproc-per-node=1), or add --share-gpus to "
                     "share them on purpose")
    with pytest.raises(UsageError, match="#SBATCH --gpus-per-node=2"):
        allocation.check_launch(TORCHRUN_2, "auto", False, 0)
    srun_tasks = DistEnv(0, 0, 4, 4, "slurm", 1)
    assert "ask for 1 task(s) per node with `#SBATCH --ntasks-per-node=1`" in \
        allocation.problems(srun_tasks, "auto", False, 0)[0]
    # on purpose: --share-gpus, or a CPU run that does not use the GPUs at all
    assert allocation.problems(TORCHRUN_2, "auto", True, 0)[0] is None
    assert allocation.problems(TORCHRUN_2, "cpu", False, 0)[0] is None
    slurm(CUDA_VISIBLE_DEVICES="")  # every GPU hidden on purpose: a CPU run
    assert allocation.problems(TORCHRUN_2, "auto", False, 0)[0] is None


def test_gpus_per_task_hiding_gpus_from_torchrun_and_a_gpu_named_twice(slurm):
    slurm(SLURM_GPUS_ON_NODE=2, CUDA_VISIBLE_DEVICES="0")
    assert "`#SBATCH --gpus-per-task` hides" in allocation.problems(TORCHRUN_2, "auto", False,
                                                                    0)[0]
    # srun tasks that each see their own one GPU are fine
    assert allocation.problems(DistEnv(1, 1, 2, 2, "slurm", 1), "auto", False, 0)[0] is None
    slurm(SLURM_GPUS_ON_NODE=2, CUDA_VISIBLE_DEVICES="1,1")
    assert "names a GPU twice" in allocation.problems(TORCHRUN_2, "auto", False, 0)[0]


def test_srun_not_passing_cpus_per_task_on_is_one_warning(slurm, capsys):
    slurm(cpus=1, SLURM_CPUS_PER_TASK=16)
    allocation.check_launch(TORCHRUN_2, "cpu", False, 7)
    assert capsys.readouterr().err.splitlines() == [
        "warning: this task on n1 may run on 1 CPU(s), but `#SBATCH --cpus-per-task=16` asked "
        "for 16: srun of Slurm 22.05 to 23.02 no longer passes it on to its tasks, so export "
        "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK before srun (launch/job.sh does), or the "
        "loader workers starve"]
    # srun was told (SRUN_CPUS_PER_TASK): the node has fewer CPUs, not this cause
    slurm(cpus=1, SLURM_CPUS_PER_TASK=16, SRUN_CPUS_PER_TASK=16)
    assert not any("SRUN_CPUS_PER_TASK" in w
                   for w in allocation.problems(TORCHRUN_2, "cpu", False, 0)[1])


def test_one_cpu_per_task_and_eight_workers_is_one_warning(slurm):
    slurm(cpus=32, SLURM_CPUS_PER_TASK=1, SRUN_CPUS_PER_TASK=1)
    one = DistEnv(0, 0, 1, 1, "torchrun", 1)
    assert allocation.problems(one, "cpu", False, 8)[1] == [
        "warning: 8 loader workers per process, but each process on n1 has 1 CPU(s) (the task "
        "has 1, `#SBATCH --cpus-per-task=1`), so the workers take turns and starve the training: "
        "change it to `#SBATCH --cpus-per-task=9`, or lower --num-workers to 0"]
    # torchrun's two workers share the task's CPUs; srun tasks have their own
    slurm(cpus=8, SLURM_CPUS_PER_TASK=8, SRUN_CPUS_PER_TASK=8)
    assert "(the task has 8, `#SBATCH --cpus-per-task=8`, shared by 2 processes), so" in \
        allocation.problems(TORCHRUN_2, "cpu", False, 4)[1][0]
    assert allocation.problems(DistEnv(0, 0, 2, 2, "slurm", 1), "cpu", False, 4) == (None, [])


@pytest.mark.parametrize("cpus, asked, source, procs, workers", [
    (16, None, "single", 1, 8),     # a workstation: at most 8
    (4, None, "single", 1, 3),      # one CPU left for the training
    (16, 16, "torchrun", 4, 3),     # torchrun's 4 processes share the task's 16 CPUs
    (16, 16, "slurm", 4, 8),        # srun's tasks each have their own
    (1, 16, "slurm", 1, 0),         # srun gave the task 1 of the 16 asked: sized by the 1
    (32, 2, "slurm", 1, 1),         # the node's 32, of which the job asked for 2
])
def test_the_default_loader_workers_follow_the_usable_cpus(slurm, monkeypatch, cpus, asked,
                                                           source, procs, workers):
    """flags.default_workers and the launch check count the same CPUs: those the task may
    run on, no more than `#SBATCH --cpus-per-task` asked for."""
    slurm(cpus=cpus, **({"SLURM_CPUS_PER_TASK": asked} if asked else {}))
    env = DistEnv(rank=0, local_rank=0, world_size=procs, local_world_size=procs, source=source)
    assert allocation.usable_cpus() == min(cpus, asked or cpus)
    assert flags.default_workers(env) == workers
    # the workers it picks never draw the launch check's warning about starving workers
    assert not [w for w in allocation.problems(env, "cpu", False, workers)[1]
                if "loader workers per process" in w]


def test_a_fixed_port_with_another_job_on_the_node_is_named(slurm, monkeypatch):
    slurm(MASTER_PORT=29500, TORCHELASTIC_RUN_ID="none")  # torchrun --master-port 29500
    asked = []
    monkeypatch.setattr(allocation, "other_jobs_on",
                        lambda node, job: asked.append((node, job)) or ["4243"])
    assert allocation.problems(TORCHRUN_2, "cpu", False, 0)[1] == [
        "warning: MASTER_PORT=29500 is fixed, and job(s) 4243 also run on n1: two jobs on one "
        "node that take the same port collide (address in use, or a rank joins the other job's "
        "rendezvous); derive it from the job id, export MASTER_PORT=$((20000 + SLURM_JOB_ID % "
        "20000)) as launch/job.sh does, or keep the node to this job with `#SBATCH --exclusive`"]
    assert asked == [("n1", "4242")]
    # the derived port, or a rank other than the node's first, asks nobody
    slurm(MASTER_PORT=allocation.derived_port("4242"))
    assert allocation.problems(TORCHRUN_2, "cpu", False, 0)[1] == []
    slurm(MASTER_PORT=29500)
    assert allocation.problems(DistEnv(1, 1, 2, 2, "torchrun", 1), "cpu", False, 0)[1] == []
    assert asked == [("n1", "4242")]
    # torchrun's c10d rendezvous: the workers' MASTER_PORT is torchrun's own free port; the
    # launcher's rendezvous endpoint is what two jobs could share
    slurm(MASTER_PORT=37605, TORCHELASTIC_RUN_ID="4242",
          RDZV_ENDPOINT=f"n1:{allocation.derived_port('4242')}")
    assert allocation.problems(TORCHRUN_2, "cpu", False, 0)[1] == []
    # a port launch/job.sh took because another process held the derived one: its own, not
    # "fixed" (it said so), and none of them is the next job's derived port or list
    ports = allocation.job_ports("4242")
    slurm(RDZV_ENDPOINT=f"n1:{ports[1]}")
    assert ports[1] == 10000 + 4242 % 10000 and len(set(ports)) == 50
    assert allocation.problems(TORCHRUN_2, "cpu", False, 0)[1] == []
    assert not set(ports) & set(allocation.job_ports("4243"))
    slurm(RDZV_ENDPOINT="n1:29400")
    assert allocation.problems(TORCHRUN_2, "cpu", False, 0)[1][0].startswith(
        "warning: the rendezvous port of RDZV_ENDPOINT=29400 is fixed, and job(s) 4243")
    monkeypatch.delenv("RDZV_ENDPOINT")  # a torchrun of the user's own: not seen
    assert allocation.problems(TORCHRUN_2, "cpu", False, 0)[1] == []


def test_the_training_stops_before_its_first_collective(tmp_path):
    """Rank 0 of 2 with one GPU for the node: exit 2 with the sentence, at once (its peer
    never comes, so a collective would wait)."""
    env = {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "n1", "SLURM_GPUS_ON_NODE": "1",
           "CUDA_VISIBLE_DEVICES": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "24242"}
    res = run_script("ddp_train.py", ["--model", "cnn", "--synthetic-size", "64", "--epochs",
                                      "1", "--num-workers", "0", "--dist-timeout", "30"],
                     env=env, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error: 2 processes were started on n1, but Slurm gave it 1 GPU(s)" in res.stderr
