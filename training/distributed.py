"""The rank layout and the process group: where this process sits among the others.

torchrun describes the layout in RANK / WORLD_SIZE / LOCAL_RANK and friends; ``srun`` without
torchrun in SLURM_PROCID / SLURM_NTASKS and the node list. ``dist_env`` reads either into one
``DistEnv``; ``gpu_index`` picks this rank's GPU; ``init_process_group`` joins the others;
``on_rank0`` and ``raise_if_any_rank`` make every rank act on what one rank found. Once the
group is up, ``rank_and_world()`` is the one answer to "which rank am I, how many are we";
``print0`` prints on rank 0 and ``all_reduce`` sums over every rank, so that a module that only
prints or reduces imports nothing above this one.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from training.faults import RankError, UsageError


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    source: str  # "torchrun", "slurm" or "single"
    num_nodes: int = 0  # 0: world_size / local_world_size (an even layout)

    @property
    def nodes(self) -> int:
        return self.num_nodes or max(1, self.world_size // max(1, self.local_world_size))


def _int_env(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise UsageError(f"${name}={os.environ[name]!r} is not an integer: unset it or fix the "
                         f"launcher that sets it") from None


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


def _check_ranks(rank: int | None, world: int | None) -> None:
    """RANK and WORLD_SIZE come together and fit each other. Alone, either one would train a
    single process while the user meant several; a rank at or above the world size would wait
    for a rendezvous that cannot complete, then blame a dead peer."""
    both = ("export both, RANK from 0 to WORLD_SIZE - 1 in each process, or neither for one "
            "process; torchrun sets them for you")
    if rank is None or world is None:
        given, missing = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
        raise UsageError(f"${given}={os.environ[given]} is set but ${missing} is not: {both}")
    if world < 1:
        raise UsageError(f"$WORLD_SIZE={world} is not a number of processes (at least 1): "
                         f"{both}")
    if not 0 <= rank < world:
        raise UsageError(f"$RANK={rank} does not fit $WORLD_SIZE={world} (ranks run from 0 to "
                         f"{world - 1}): {both}")


def dist_env() -> DistEnv:
    """Rank layout from torchrun (RANK/LOCAL_RANK/WORLD_SIZE) or, started by ``srun`` without
    torchrun, from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; one process otherwise.

    Under the Slurm fallback MASTER_ADDR defaults to the step's first node and MASTER_PORT to
    20000 + job id % 20000 (the launchers use the same rule), so ``srun python ddp_train.py``
    works without extra exports.
    """
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        world = _int_env("WORLD_SIZE") if "WORLD_SIZE" in os.environ else None
        rank = _int_env("RANK") if "RANK" in os.environ else None
        _check_ranks(rank, world)
        local_world = (_int_env("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ
                       else world)
        if not 1 <= local_world <= world:
            raise UsageError(f"$LOCAL_WORLD_SIZE={local_world} is not a number of processes on "
                             f"this node (1 to WORLD_SIZE={world}): unset it, or let torchrun "
                             f"set it")
        return DistEnv(rank, _int_env("LOCAL_RANK") if "LOCAL_RANK" in os.environ
                       else 0, world, local_world, "torchrun",  # its nodes: GROUP_WORLD_SIZE
                       _int_env("GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in os.environ else 0)
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


def gpu_index(visible: int, local_rank: int, local_world_size: int, source: str,
              share: bool = False) -> int:
    """Which of the ``visible`` GPUs this process drives (a pure function of the layout).

    - One GPU visible to a process that srun started as its own task: srun --gpus-per-task=1
      or --gpu-bind gave each task its own GPU, always cuda:0 inside the task.
    - Otherwise local rank i drives GPU i, so the node needs a GPU per local process, unless
      ``share`` (--share-gpus): then local rank i drives GPU i mod ``visible``.
    """
    if visible == 1 and (source == "slurm" or local_world_size == 1):
        return 0
    if local_world_size > visible and share:
        return local_rank % visible
    if local_world_size > visible:
        fix = (f"use --nproc-per-node {visible}" if source == "torchrun" else
               f"start {visible} task(s) per node, or give each task its own GPU with srun "
               f"--gpus-per-task=1")
        raise UsageError(f"{local_world_size} processes were started on this node but only "
                         f"{visible} GPU(s) are visible: {fix} (or request more GPUs)")
    return local_rank


def sharing_gpus(visible: int, env: DistEnv, share: bool) -> bool:
    """Whether ranks of this node share GPUs: --share-gpus, and more local ranks than GPUs
    (srun tasks that each see one GPU have one of their own)."""
    return share and env.local_world_size > visible and not (
        visible == 1 and env.source == "slurm")


def shared_gpu_lines(visible: int, env: DistEnv) -> list:
    """What the start-up says when ranks share GPUs, and why it is slow."""
    return [f"note: --share-gpus: {env.local_world_size} processes share {visible} GPU(s) "
            f"round-robin (local rank i on cuda:i mod {visible}); they talk over gloo, because "
            f"NCCL refuses two ranks on one GPU, so every collective goes through host memory "
            f"and the GPUs take turns: slow, for trying the multi-rank code paths on CUDA, not "
            f"for timing"]


def check_gloo_on_cuda(device, uses: list) -> None:
    """Run each collective the strategy will use once over gloo, on a small tensor of
    ``device`` and on the group it will run it on (``uses``: (collective, group) pairs, group
    None: every rank's), and check the values it returns. A collective this torch's gloo lacks
    for CUDA tensors, or gets wrong (its AVG reduce-scatter gave wrong averages before torch
    2.9), is then one sentence now, not a crash at the first step or quietly wrong gradients.
    Collective: every rank calls it with the same ``uses``, and every rank stops if one
    rank's check failed."""
    error = None
    for op, group in uses:
        try:
            got, due = _probe(op, device, group)
        except (RuntimeError, NotImplementedError) as e:
            first = (str(e).strip() or type(e).__name__).splitlines()[0]
            error = error or (f"--share-gpus: gloo in this torch has no {op} for CUDA tensors "
                              f"({first[:160]}), which this strategy needs: start one process "
                              f"per GPU, without --share-gpus")
            continue
        if not torch.allclose(got, due):
            error = error or (f"--share-gpus: gloo's {op} of CUDA tensors in this torch "
                              f"returned {got.tolist()} on rank {dist.get_rank()} where "
                              f"{due.tolist()} is due, so training on it would go wrong: "
                              f"start one process per GPU, without --share-gpus")
    raise_if_any_rank(error)


def _probe(op: str, device, group) -> tuple:
    """(what ``op`` returned on this rank, what is due). Rank r of the group gives 2n values,
    1 to 2n times r + 1, so that a sum, an average and another rank's chunk all differ:
    all_reduce sums (the metrics, DDP's buckets); all_reduce_avg and reduce_scatter_avg
    average (FSDP's gradients: between the replicas of --sharding hybrid, and into each
    rank's shard); all_gather and broadcast copy (FSDP's parameters, DDP's start)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    base = torch.arange(1, 2 * n + 1, dtype=torch.float32, device=device)
    mine, mean = base * (rank + 1), (n + 1) / 2  # the mean of rank + 1 over the group
    if op == "all_reduce":
        got = mine.clone()
        dist.all_reduce(got, group=group)
        return got, base * n * mean
    if op == "all_reduce_avg":
        got = mine.clone()
        dist.all_reduce(got, op=dist.ReduceOp.AVG, group=group)
        return got, base * mean
    if op == "reduce_scatter_avg":
        got = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(got, mine, op=dist.ReduceOp.AVG, group=group)
        return got, (base * mean)[2 * rank:2 * rank + 2]
    if op == "all_gather":
        got = torch.empty(2 * n * n, device=device)
        dist.all_gather_into_tensor(got, mine, group=group)
        return got, torch.cat([base * (r + 1) for r in range(n)])
    if op == "broadcast":  # from the group's first rank
        got = mine.clone()
        first = 0 if group is None else dist.get_process_group_ranks(group)[0]
        dist.broadcast(got, src=first, group=group)
        return got, base
    raise ValueError(f"no probe for the collective {op!r}")


def simulated(world: int, env: DistEnv) -> DistEnv:
    """--simulate-world-size: this one process as rank 0 of ``world``, all on one node."""
    if env.world_size > 1:
        raise UsageError(f"--simulate-world-size runs one process as rank 0 of "
                         f"{world}: start it with python, not with {env.world_size} processes "
                         f"(torchrun or srun)")
    return DistEnv(0, 0, world, 1, "simulated", num_nodes=1)


def init_process_group(backend: str, env: DistEnv, timeout_s: int) -> None:
    """Join the global process group (all ranks). A single process gets an in-memory store,
    so `python script.py` needs no MASTER_ADDR/PORT and runs the same DDP/FSDP code path.
    --simulate-world-size: torch's fake process group, where rank 0 of N has no peers and every
    collective returns at once, its tensors untouched."""
    timeout = timedelta(seconds=timeout_s)
    if env.source == "simulated":
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=env.world_size)
        return
    check_socket_interfaces(backend, env.world_size)
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise UsageError("MASTER_PORT is not set: start with torchrun (which sets it) or "
                             "export MASTER_ADDR and MASTER_PORT")
        if env.rank != 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
            wait_for_rank0(timeout_s)  # under torchrun, its own store has answered torchrun
        try:
            dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
        except dist.DistNetworkError as err:
            if not _address_in_use(err):
                raise
            addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
            raise UsageError(f"MASTER_ADDR:MASTER_PORT {addr}:{port} is already taken by "
                             f"another program, so rank 0 cannot open the rendezvous there: "
                             f"export another free MASTER_PORT (one that `ss -ltn` does not "
                             f"list) in every process, or end the program that holds "
                             f"{port}") from None


def _address_in_use(err: Exception) -> bool:
    """Rank 0's rendezvous store could not listen: its address and port are taken (errno
    EADDRINUSE), which torch reports as a DistNetworkError like a lost peer."""
    text = str(err).lower()
    return "eaddrinuse" in text or "address already in use" in text


#: How long a rank other than 0 waits for an answer from what listens at MASTER_ADDR:MASTER_PORT
#: (at most --dist-timeout). Rank 0's store answers in milliseconds; another program that
#: holds the port accepts the connection and never answers, and torch's store client then
#: waits for its handshake without any timeout.
RANK0_ANSWER_S = 20


def wait_for_rank0(timeout_s: int) -> None:
    """Before a rank other than 0 joins the rendezvous: wait until something listens at
    MASTER_ADDR:MASTER_PORT (rank 0 may start later, up to --dist-timeout), then check that it
    answers as rank 0's store does, within RANK0_ANSWER_S. When rank 0 finds the port taken by
    another program it says so and stops; without this check every other rank would wait
    silently for that program, longer than --dist-timeout."""
    addr, port = os.environ["MASTER_ADDR"], _int_env("MASTER_PORT")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RankError(f"nothing listened at {addr}:{port} within --dist-timeout "
                                f"{timeout_s} s: rank 0 did not start, died first, or was "
                                f"given another MASTER_ADDR or MASTER_PORT; look for rank 0's "
                                f"error, and export the same MASTER_ADDR and MASTER_PORT in "
                                f"every process") from None
            time.sleep(1)
    bound = min(RANK0_ANSWER_S, timeout_s)
    answer = []  # the store, or the error it raised

    def connect():
        try:
            answer.append(dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                                        timeout=timedelta(seconds=bound)))
        except Exception as err:  # noqa: BLE001 (any failure is "no answer", said below)
            answer.append(err)

    # A thread, because a store client that met another program blocks in C++ for good;
    # it stays blocked there until the process exits.
    threading.Thread(target=connect, daemon=True).start()
    give_up = time.monotonic() + bound
    while not answer and time.monotonic() < give_up:
        time.sleep(0.1)
    if not answer or isinstance(answer[0], Exception):
        raise RankError(f"no rank 0 answered at {addr}:{port} within {bound} s: the port may "
                        f"be taken by another program (rank 0 then says so) or rank 0 died; "
                        f"look for rank 0's error, and export a free MASTER_PORT (one that "
                        f"`ss -ltn` does not list) in every process")
    del answer[:]  # closes this check's connection; the rendezvous opens its own


def _has_address(name: str) -> bool:
    """Whether network interface ``name`` has an address, as gloo looks it up (IPv4 or
    IPv6): gloo and NCCL can use only such an interface."""
    if not dist.is_gloo_available():
        return True  # no way to ask: leave the judgement to the backend
    try:
        dist.ProcessGroupGloo.create_device(interface=name)
        return True
    except RuntimeError:
        return False


def nccl_interfaces(form: str, names: list) -> list:
    """The interfaces of ``names`` that NCCL_SOCKET_IFNAME=``form`` lets NCCL consider: a
    comma-separated list of name prefixes, of exact names after a leading '=', and every
    interface but those listed after a leading '^' (or '^='); an entry may end in ':port'."""
    exclude = form.startswith("^")
    form = form[exclude:]
    exact = form.startswith("=")
    wants = [w.split(":")[0] for w in form[exact:].split(",") if w.split(":")[0]]

    def listed(name):
        return any(name == w if exact else name.startswith(w) for w in wants)
    return [name for name in names if listed(name) != exclude]


def check_socket_interfaces(backend: str, world_size: int) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME choose the network interface of each rank.
    One that this host lacks failed only at the first collective, seconds later, as if a peer
    had died (even in a single process): say so now, naming the interfaces there are. gloo
    is used for a gloo backend and, in every run of several processes, for the stop vote."""
    host = socket.gethostname()
    names = [name for _, name in socket.if_nameindex()]

    def interfaces():
        usable = [name for name in names if _has_address(name)]
        others = [name for name in names if name not in usable]
        return (f"this host's interfaces with an address are {', '.join(usable) or 'none'}"
                + (f" (without one: {', '.join(others)})" if others else ""))

    # Both read a value of one character as unset.
    gloo = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(gloo) > 1 and ("gloo" in backend or world_size > 1):
        missing = [name for name in gloo.split(",") if not _has_address(name)]
        if missing:
            raise UsageError(f"GLOO_SOCKET_IFNAME={gloo!r} names {', '.join(missing)}, not an "
                             f"interface with an address on this host ({host}), which gloo "
                             f"needs: {interfaces()}; export one of them (or a comma-separated "
                             f"list) in every process, or unset GLOO_SOCKET_IFNAME to let gloo "
                             f"take the address of the host name")
    nccl = os.environ.get("NCCL_SOCKET_IFNAME", "")
    if len(nccl) > 1 and "nccl" in backend:
        if not any(_has_address(name) for name in nccl_interfaces(nccl, names)):
            raise UsageError(f"NCCL_SOCKET_IFNAME={nccl!r} lets NCCL use no interface with an "
                             f"address on this host ({host}): NCCL reads a comma-separated list "
                             f"of name prefixes, '=' before exact names, '^' before the names to "
                             f"leave out, and {interfaces()}; export a prefix of one of them in "
                             f"every process, or unset NCCL_SOCKET_IFNAME to let NCCL choose")


_layout: DistEnv | None = None  # this process's place, as common.run() found it


def set_layout(env: DistEnv | None) -> None:
    """Record where this process sits (common.run(), once dist_env() has read it), so that
    rank_and_world() can answer before the process group is up; None when the run is over."""
    global _layout
    _layout = env


def is_distributed() -> bool:
    """Whether this process is in a process group: not DataParallel's one process, nor a run
    before the group is up (--estimate-memory never starts one)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple:
    """(this process's rank, the number of ranks): the process group's once it is up, before
    that the layout common.run() recorded (set_layout), else (0, 1): one process. The one way
    the code asks it; the launcher's variables are read once, by dist_env()."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    if _layout is not None:
        return _layout.rank, _layout.world_size
    return 0, 1


_prefix = ""  # --simulate-world-size: every line says it is a simulation


def print0(*values) -> None:
    """print on rank 0 only, flushed: logs are read with tail -f."""
    if rank_and_world()[0] == 0:
        print(_prefix + " ".join(map(str, values)), flush=True)


def set_print_prefix(prefix: str) -> None:
    global _prefix
    _prefix = prefix


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``dist.all_reduce`` in place over every rank (a collective: all ranks call it). Without
    a process group it does nothing: DataParallel's one process holds every GPU's numbers."""
    if rank_and_world()[1] > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def on_rank0(fn):
    """Run ``fn`` on rank 0 only while the other ranks wait; a UsageError there is raised on
    every rank (through a broadcast), so nobody waits forever. Without a process group
    (DataParallel) it simply runs ``fn``."""
    if not is_distributed():
        return fn()
    result, box = None, [None]  # box: rank 0's error, if any
    if rank_and_world()[0] == 0:
        try:
            result = fn()
        except UsageError as exc:
            box = [str(exc)]
    dist.broadcast_object_list(box, src=0)  # collective: every rank waits here for rank 0
    if box[0] is not None:
        raise UsageError(box[0])
    return result


def every_rank(value, group=None) -> list:
    """Collective (every rank calls it): every rank's ``value`` (any picklable object), in rank
    order, on ``group`` (default: the run's). Without a process group: [value]."""
    if not is_distributed():
        return [value]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def raise_if_any_rank(error: str | None, group=None) -> None:
    """Collective (every rank calls it): each rank passes its own error sentence, or None, and
    every rank raises the first one as a UsageError, so no rank goes on while another stops.
    Also the wait for the slowest rank (on ``group``, with its timeout; default: the run's
    group and --dist-timeout). Without a process group: this rank's error only."""
    error = next((e for e in every_rank(error, group) if e), None)
    if error:
        raise UsageError(error)


def seed_for_rank(seed: int, rank: int) -> int:
    """The seed of one rank's own randomness: crops, flips, dropout, DataLoader workers.

    Model init uses ``seed`` itself on every rank (identical weights). Everything drawn after
    it must differ between ranks, or rank r's i-th sample gets the same crop as rank 0's i-th
    sample at every step; it stays reproducible from (seed, rank)."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
