"""Which rank holds the others back: every rank's own time and its waits, every epoch.

In data-parallel training every step waits for the slowest rank: a throttling GPU, a node with
a busy CPU or a slow disk, and the whole job runs at its pace while the other ranks idle in the
collectives. The epoch's time alone cannot say which rank that is, because every rank's epoch
takes as long as the slowest one's. What tells them apart is where the time went:

- ``rank_wait_s``: time this rank spent blocked in a collective, waiting for the others;
- ``data_wait_s``: time it waited for its loader (StepMeter.data_wait_s);
- ``compute_s``: the rest of its training time, its own work (forward, backward, optimizer).

A rank's *own* time is compute + data wait: the slow rank has the most of it, and the ranks
that wait for it have less own time and more ``rank_wait_s``. Each rank measures its waits on
its own, without a host sync per step (host clocks on the CPU, CUDA events read at the epoch's
end on a GPU), and at the epoch's end one gather brings every rank's figures to rank 0.

Where the waits are measured, per strategy:

- DDP: a comm hook around the default all-reduce notes when this rank's last gradient bucket
  is ready (its arrival at the step's synchronisation point); the optimizer's step pre-hook
  notes when backward ended, after DDP waited for every bucket's all-reduce. The span between
  the two is the wait for the others (and the last bucket's own all-reduce). With BatchNorm
  buffers broadcast before each forward, the span of that broadcast counts too, and with
  --zero1 the broadcast of the updated parameters after the optimizer's step. --cuda-graph
  replays the step without running Python hooks: no wait is measured, and as every rank's
  training time is the same (all wait for the slowest), no rank can be named: the [METRIC]
  line then says slowest_rank=nan rank_spread=nan.
- FSDP2: each unit's parameter group is all-gathered before its forward and backward, and its
  gradients reduce-scattered after backward; the time this rank spends in those collectives
  (on a GPU: the compute stream's waits for them) is the wait for the others.
- DataParallel: one process, its "ranks" are its devices. On a GPU, CUDA events around each
  replica's forward and backward on its own device give each device's compute; on the CPU there
  is one device, which is never a straggler.

``RankClock.end_epoch`` is a collective (every rank calls it); rank 0 prints the straggler line
(``straggler_line``) and the ``[RANKS]`` line, and the [METRIC] line carries ``slowest_rank``
and ``rank_spread``.
"""

from __future__ import annotations

import math
import socket
import statistics
import time

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from training import contract, hangs, torch_private
from training.distributed import every_rank, print0, rank_and_world

#: A rank whose own time is this much above the median rank's is named.
SLOW_FACTOR = contract.SLOW_RANK_SPREAD

#: Unread CUDA event pairs kept before the finished ones are folded into a sum (no sync).
FOLD_AFTER = 256


# --------------------------------------------------------------------------------------------
# The analysis: rank 0, from every rank's figures
# --------------------------------------------------------------------------------------------

def analyse(ranks: list) -> dict:
    """``ranks``: one dict per rank (own_s, compute_s, data_wait_s, rank_wait_s, node, device),
    in rank order. Returns slowest_rank, rank_spread (its own time over the median rank's), and,
    when it is more than SLOW_FACTOR above the median, ``straggler``: its rank, how much slower
    (%) than the median rank (of two ranks: the other one) and where its extra time went
    ("compute" or "data")."""
    own = [r["own_s"] for r in ranks]
    median = statistics.median(own)
    slowest = max(range(len(own)), key=lambda i: own[i])
    spread = own[slowest] / median if median > 0 else 1.0
    result = dict(slowest_rank=slowest, rank_spread=spread, straggler=None)
    if spread > SLOW_FACTOR:
        extra_compute = ranks[slowest]["compute_s"] - statistics.median(
            r["compute_s"] for r in ranks)
        extra_data = ranks[slowest]["data_wait_s"] - statistics.median(
            r["data_wait_s"] for r in ranks)
        # Of two ranks the median is their mean, no rank's time (a rank 63% slower than the
        # other is 24% above it): the line compares with the other rank then
        against, against_s = ("other", min(own)) if len(own) == 2 else ("median", median)
        result["straggler"] = dict(rank=slowest, against=against, against_s=against_s,
                                   slower_pct=100 * (own[slowest] / against_s - 1),
                                   cause="data" if extra_data > extra_compute else "compute",
                                   **ranks[slowest])
    return result


def straggler_line(epoch: int, found: dict, what: str = "rank") -> str:
    """The line people read, naming the slow rank (or device, ``what``) that ``analyse`` found."""
    s = found["straggler"]
    where = ("its loader (data wait)" if s["cause"] == "data"
             else "its own compute (forward, backward, optimizer)")
    return (f"straggler: epoch {epoch}: {what} {s['rank']} on {s['node']} ({s['device']}) is "
            f"{s['slower_pct']:.0f}% slower than the {s['against']} {what} ({s['own_s']:.2f} s "
            f"of own time vs {s['against_s']:.2f} s); its extra time went to {where}; the others "
            f"waited for it")


def _label(text: str) -> str:
    """A node or device name as one token of a comma-separated [RANKS] value."""
    return text.replace(" ", "_").replace(",", "_").replace("=", "_") or "-"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return _label(f"cuda:{device.index}:{torch.cuda.get_device_name(device)}")
    return device.type


# --------------------------------------------------------------------------------------------
# Timing waits without a host sync per step
# --------------------------------------------------------------------------------------------

class Spans:
    """A sum of time spans on one device: host clocks on the CPU; on a GPU, CUDA events on the
    current stream, read at the epoch's end (the finished ones folded in now and then with
    Event.query(), which does not block)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.total_s, self.pending, self.opened = 0.0, [], None

    def mark(self):
        """A point in time: the host clock, or an event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, start, end) -> None:
        if not self.cuda:
            self.total_s += end - start
            return
        self.pending.append((start, end))
        if len(self.pending) > FOLD_AFTER:
            while self.pending and self.pending[0][1].query():
                first, last = self.pending.pop(0)
                self.total_s += first.elapsed_time(last) / 1e3

    def open(self) -> None:
        """A span starts now (a later open replaces one not yet closed)."""
        self.opened = self.mark()

    def close(self) -> None:
        """The span opened last ends now; nothing when none is open."""
        if self.opened is not None:
            self.add(self.opened, self.mark())
            self.opened = None

    def seconds(self) -> float:
        """The sum of the spans; on a GPU, call after the device was synchronised."""
        total = self.total_s + sum(a.elapsed_time(b) / 1e3 for a, b in self.pending)
        self.pending = []
        self.total_s = total
        return total


class RankClock:
    """This rank's waits for the other ranks, summed over an epoch, and the epoch's per-rank
    figures gathered to rank 0 (``end_epoch``)."""

    what = "rank"

    def __init__(self, device: torch.device, measured: bool = True):
        self.device = device
        # False where the waits cannot be timed (--cuda-graph's replay runs no hooks): every
        # rank's training time is then the same, as all wait for the slowest, and names nobody
        self.measured = measured
        self.waits = Spans(device)
        self.node, self.device_label = _label(socket.gethostname()), device_name(device)
        self.lines = []

    def start_epoch(self) -> None:
        self.waits.reset()

    def figures(self, train_time: float, data_wait: float) -> list:
        """This process's figures: one dict per rank it is (DataParallel: per device)."""
        rank_wait = min(self.waits.seconds(), max(0.0, train_time - data_wait))
        compute = max(0.0, train_time - data_wait - rank_wait)
        return [dict(own_s=compute + data_wait, compute_s=compute, data_wait_s=data_wait,
                     rank_wait_s=rank_wait, node=self.node, device=self.device_label)]

    def end_epoch(self, epoch: int, train_time: float, data_wait: float) -> dict:
        """Collective (every rank), right after the epoch's training (before evaluation, whose
        collectives are no training step's): every rank's figures to rank 0. Returns the
        [METRIC] keys slowest_rank and rank_spread; ``report`` prints the lines. ``epoch``:
        1-based; train_time, data_wait: this rank's, in s, after the device was synchronised.
        Without measured waits both keys are nan, on every rank (the same flags everywhere)."""
        if not self.measured:
            return dict(slowest_rank=math.nan, rank_spread=math.nan)
        ranks = [r for each in every_rank(self.figures(train_time, data_wait)) for r in each]
        found = analyse(ranks)
        self.lines = [straggler_line(epoch, found, self.what)] if found["straggler"] \
            else []
        if len(ranks) > 1:
            self.lines.append(contract.format_ranks_line(epoch, ranks))
        return dict(slowest_rank=found["slowest_rank"], rank_spread=found["rank_spread"])

    def report(self) -> None:
        """Rank 0, after the epoch's [METRIC] line: the straggler line when a rank is more
        than SLOW_FACTOR slower than the median, and the [RANKS] line (world size > 1)."""
        for line in self.lines:
            print0(line)
        self.lines = []


# --------------------------------------------------------------------------------------------
# Per strategy: where the waits are
# --------------------------------------------------------------------------------------------

def watch(step_model: nn.Module, optimizer, device: torch.device, cuda_graph: bool,
          broadcast_buffers: bool) -> RankClock:
    """The clock of this script's step, by the strategy its model is wrapped in (under
    --compile, the module compiled): DataParallel's devices, DDP's comm hook, FSDP's units.
    ``cuda_graph``: --cuda-graph, whose replay runs no hooks; ``broadcast_buffers``: DDP's
    --broadcast-buffers."""
    model = getattr(step_model, "_orig_mod", step_model)
    if isinstance(model, nn.DataParallel):
        devices = [torch.device("cuda", i) for i in model.device_ids] or [device]
        return DeviceClocks(model.module, devices)
    if rank_and_world()[1] == 1:  # no other rank to wait for: no hooks in the step
        return RankClock(device)
    hangs.watch(step_model, optimizer, device)  # every rank's collectives on record
    if isinstance(model, DistributedDataParallel):
        return watch_ddp(model, optimizer, device, cuda_graph, broadcast_buffers,
                         compiled=model is not step_model)
    # FSDP's and ZeRO's packages are imported where they are used (here, in watch_ddp): they
    # load DTensor's, about 1 s, which a refusal of a flag or a --help need not wait for
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return watch_fsdp(units, device) if units else RankClock(device)  # FSDP: the root too


def unmeasured(device: torch.device, why: str) -> RankClock:
    """A clock that measures no waits, after rank 0's note of ``why`` (the words before "the
    waits ..."): its [METRIC] line says rank_spread=nan rather than a spread of zeros."""
    print0(f"note: {why} the waits for other ranks are not measured and no straggler can be "
           f"named (rank_spread=nan)")
    return RankClock(device, measured=False)


def watch_ddp(replica, optimizer, device: torch.device, cuda_graph: bool,
              broadcast_buffers: bool, compiled: bool) -> RankClock:
    """DDP: the wait from this rank's last gradient bucket to the end of backward (a comm hook
    wrapping the default all-reduce, and the optimizer's step pre-hook), and the broadcast of
    BatchNorm buffers before each forward (with ``broadcast_buffers``, but not when
    ``compiled``, under --compile). Under --cuda-graph (``cuda_graph``) nothing is timed: the
    replay runs no hooks."""
    if cuda_graph:
        return unmeasured(device, "--cuda-graph: graph replay runs no Python hooks, so")
    clock = RankClock(device)

    def arrive(process_group, bucket):
        hangs.set_phase(f"backward.bucket{bucket.index()}")
        # this rank's gradients are all computed: from here until the end of backward it
        # waits for the other ranks (the all-reduces, every rank taking part)
        if bucket.is_last():
            clock.waits.open()
        return allreduce_hook(process_group, bucket)

    replica.register_comm_hook(None, arrive)
    optimizer.register_step_pre_hook(lambda *_: clock.waits.close())
    from torch.distributed.optim import ZeroRedundancyOptimizer  # see watch
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        # --zero1: after its step each rank broadcasts its partition of the parameters, and
        # every rank receives the others': a wait for the rank that steps slowest
        try:
            torch_private.wrap_zero_broadcast(optimizer, lambda sync: _timed(sync, clock.waits))
        except torch_private.TorchInternalMoved as moved:
            return unmeasured(device, f"{moved};")
    has_buffers = any(True for _ in replica.module.buffers())
    # DDP broadcasts rank 0's buffers before each forward (not timed under --compile, whose
    # trace would take the forward hooks in)
    if has_buffers and broadcast_buffers and not compiled:
        replica.register_forward_pre_hook(lambda *_: clock.waits.open())
        replica.module.register_forward_pre_hook(lambda *_: clock.waits.close())
    return clock


def watch_fsdp(units: list, device: torch.device) -> RankClock:
    """FSDP2: the time each unit's parameter group spends in FSDP's unshard (issuing the
    all-gather, which blocks on gloo) and its wait for it, in forward and backward, and in its
    post-backward (the gradients' reduce-scatter, which blocks on gloo; on a GPU it runs on
    FSDP's own stream, and the compute stream waits for it here and at the end of backward,
    in finalize_backward, also timed): every rank takes part in each of
    these collectives, so this is where a fast rank waits for a slow one. These are private
    methods of FSDP's parameter groups, reached through torch_private.py: on a torch that
    moved them nothing is timed, and a note says so."""
    clock = RankClock(device)
    # On the CPU, gloo's collectives block the host where FSDP issues them; on a GPU they run
    # on FSDP's own streams, and the compute stream waits for them in only these two
    names = (("wait_for_unshard", "finalize_backward") if device.type == "cuda" else
             ("unshard", "wait_for_unshard", "post_backward", "finalize_backward"))
    timed = 0
    try:
        for unit in units:
            for group in torch_private.fsdp_param_groups(unit):
                torch_private.wrap_fsdp_group_methods(group, names,
                                                      lambda method: _timed(method, clock.waits))
                timed += 1
    except torch_private.TorchInternalMoved as moved:
        return unmeasured(device, f"{moved};")
    if not timed:
        return unmeasured(device, f"this torch ({torch.__version__}) hides FSDP's parameter "
                                  f"groups:")
    return clock


def _timed(method, spans: Spans):
    """``method``, with the time each call takes added to ``spans``."""
    def timed(*args, **kwargs):
        start = spans.mark()
        try:
            return method(*args, **kwargs)
        finally:
            spans.add(start, spans.mark())
    return timed


class DeviceClocks(RankClock):
    """DataParallel: one process, its devices are its "ranks". On GPUs, CUDA events on each
    replica's device give its compute: its forward (forward pre-hook to forward hook, which
    DataParallel copies onto each replica) and its backward (from the gradient of its output to
    that of its first parameter, the last one backward computes). What is left of the training
    time is the device's wait for the slowest one (scatter, gather, the host); the loader's wait
    is the one process's, the same for every device. On the CPU: one device, its whole training
    time is its own."""

    what = "device"

    def __init__(self, module, devices: list):
        super().__init__(devices[0])
        # one device is never a straggler (and a --cuda-graph capture takes no timed events)
        self.compute = {d: Spans(d) for d in devices if d.type == "cuda"} \
            if len(devices) > 1 else {}
        if self.compute:
            self.watch(module)

    def watch(self, module) -> None:
        module.register_forward_pre_hook(self._forward_starts)
        module.register_forward_hook(self._forward_ends)

    def _spans(self, args) -> Spans | None:
        """The spans of the device a replica's inputs are on."""
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return self.compute.get(tensor.device) if tensor is not None else None

    def _forward_starts(self, module, args) -> None:
        if (spans := self._spans(args)) is not None:
            spans.open()

    def _forward_ends(self, module, args, output) -> None:
        spans = self._spans(args)
        if spans is None:
            return
        spans.close()
        first = next(_replica_parameters(module), None)
        if isinstance(output, torch.Tensor) and output.requires_grad and first is not None \
                and first.requires_grad:
            def backward_starts(grad):  # the gradient of this replica's output
                spans.open()

            def backward_ends(grad):  # that of its first layer: its backward is done
                spans.close()
            output.register_hook(backward_starts)
            first.register_hook(backward_ends)

    def start_epoch(self) -> None:
        for spans in self.compute.values():
            spans.reset()

    def figures(self, train_time: float, data_wait: float) -> list:
        if not self.compute:
            return super().figures(train_time, data_wait)
        rows = []
        for device, spans in self.compute.items():
            compute = spans.seconds()
            rows.append(dict(own_s=compute + data_wait, compute_s=compute,
                             data_wait_s=data_wait,
                             rank_wait_s=max(0.0, train_time - data_wait - compute),
                             node=self.node, device=device_name(device)))
        return rows


def _replica_parameters(module):
    """The parameters of a module in order; of a DataParallel replica, the copies it computes
    with (kept in _former_parameters: a replica's _parameters are empty)."""
    for m in module.modules():
        yield from (p for p in (getattr(m, "_former_parameters", None) or m._parameters).values()
                    if p is not None)
