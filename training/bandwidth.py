"""--check and --profile: the bandwidth of the strategy's collectives, timed the way nccl-tests
time them, one ``[BANDWIDTH]`` line each, with the network that carried them. ``collective_check``
(--check) first tests an all-reduce with a known answer; ``bus_bandwidth`` times the
collectives; ``transport`` joins every rank's view of the network. Reading NCCL's log and the
floors of each network are training/network.py's, which imports no torch.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from training import network
from training.contract import BANDWIDTH_PREFIX
from training.distributed import every_rank, print0, rank_and_world
from training.measure import synchronize

#: Bus bandwidth as nccl-tests define it: busbw = algbw x this factor at n ranks, so that one
#: figure compares with the links' speed whatever the collective (algbw = bytes / time, with
#: bytes = the whole buffer: the all-reduce's, all-gather's output, reduce-scatter's input).
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}


def _time_collective(op: str, nbytes: int, device: torch.device, world: int) -> float:
    """Seconds per call of ``op`` over a buffer of ``nbytes`` (every rank takes part)."""
    whole = torch.ones(nbytes // 4, device=device)
    shard = torch.ones(nbytes // 4 // world, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    call = {"all_reduce": lambda: dist.all_reduce(whole),
            "all_gather": lambda: gather(whole, shard),
            "reduce_scatter": lambda: scatter(shard, whole)}[op]
    for _ in range(2):  # warm-up: connections, buffers
        call()
    synchronize(device)
    iters = 5
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize(device)
    return (time.perf_counter() - t0) / iters


def bus_bandwidth(device: torch.device, world: int, sizes: list, ops=("all_reduce",),
                  messages: dict | None = None) -> list:
    """One ``[BANDWIDTH]`` line per collective in ``ops`` and message size in ``sizes``
    (bytes, rounded to whole float32 shards), every rank taking part; returns the sizes used.
    Bus bandwidth as nccl-tests report it: the figure to compare with the links' nominal one,
    and the transport that carried it (``transport``: known once the collectives have made
    their connections, so the lines are printed after all of them ran). A warning follows when
    a multi-node job runs over sockets beside InfiniBand, or a collective is under its
    transport's floor (training/network.py). ``messages``: how many collectives of each kind a
    training step makes (the scaling model's latency term), added to the lines as messages=N."""
    unit = 4 * world  # whole float32 elements, and a shard per rank
    sizes = sorted({max(unit, nbytes // unit * unit) for nbytes in sizes})
    timed = [(op, nbytes, _time_collective(op, nbytes, device, world))
             for op in ops for nbytes in sizes]
    used, warnings = transport()
    for op, nbytes, seconds in timed:
        algbw = nbytes / seconds / 1e9
        busbw = algbw * BUS_FACTOR[op](world)
        print0(f"{BANDWIDTH_PREFIX} op={op} bytes={nbytes} world_size={world} "
               f"time_ms={seconds * 1e3:.3f} algbw_gbs={algbw:.3f} busbw_gbs={busbw:.3f} "
               f"transport={used}"
               + (f" messages={messages[op]}" if messages and op in messages else ""))
        if nbytes == sizes[-1]:
            warnings.append(network.below_floor(op, nbytes, busbw, used))
    for warning in filter(None, warnings):
        print0(warning)
    return sizes


def transport() -> tuple:
    """Collective (every rank calls it): the transport of the run's collectives as the
    ``transport=`` value (training/network.py), from every rank's own view joined, and the
    sentence that warns when a multi-node NCCL job runs over sockets beside InfiniBand (in a
    list, None when there is none). gloo: TCP, over its interface. NCCL: the connections its
    INFO lines name, in the log capture_nccl_log set up (--check, --profile)."""
    log = network.captured_log()
    mine, note = [network.gloo_transport()], None
    if "nccl" in str(dist.get_backend()):
        mine, note = [], "NCCL's INFO lines were not captured (no NCCL_DEBUG_FILE)"
        if log is not None:
            try:
                mine = list(network.parse_nccl_log(log.read_text(errors="replace"))["connections"])
                note = f"NCCL's INFO lines: {log} (rank 0's; one file per process)"
                if not mine:
                    note = f"{log} names no connection (a NCCL_DEBUG_SUBSYS without INIT?)"
            except OSError as err:
                note = f"NCCL's log {log} is unreadable ({err.strerror})"
    everyone = every_rank((socket.gethostname(), mine, network.ib_devices()))
    used = network.join_transports(t for _, transports, _ in everyone for t in transports)
    if note:
        print0(f"transport: {used} ({note})")
    nodes = len({host for host, _, _ in everyone})
    return used, [network.sockets_despite_ib(used, nodes, {h: ib for h, _, ib in everyone})]


def collective_check(device: torch.device, world: int, grad_bytes: int,
                     ops: tuple = ("all_reduce",)) -> None:
    """--check: an all-reduce with a known answer, then the bandwidth of ``ops`` on this very
    allocation at four message sizes up to the model's gradient size, one ``[BANDWIDTH]``
    line each (bus bandwidth as nccl-tests report it: compare it with the fabric's nominal
    figure; a slow node or a wrong network interface shows here). Every rank takes part."""
    rank = rank_and_world()[0]
    probe = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    expected = world * (world + 1) / 2
    got = probe[0].item()
    if got != expected:
        raise RuntimeError(f"all-reduce returned {got}, expected {expected}: the collective "
                           f"backend is broken between these ranks")
    print0(f"check: all-reduce OK across {world} rank(s) (sum {got:g} == {expected:g})")
    if world == 1:
        print0("check: one rank: no bandwidth to measure")
        return
    sizes = bus_bandwidth(device, world, [grad_bytes // d for d in (64, 16, 4, 1)], ops)
    print0(f"check: bandwidth measured up to {sizes[-1] / 2**20:.1f} MiB, the model's gradient "
           f"size (busbw: the figure to compare with the links' nominal bandwidth)")
