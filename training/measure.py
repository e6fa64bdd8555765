"""What a run measures about itself: the figures of each epoch's [METRIC] line, the progress
line, the time spent waiting for data, a profile of a few steps (--profile) and the bandwidth of
the collectives (--check). Each answers a question a user asks of a running job:

- "how fast, how good, how much memory?": ``epoch_metrics``, from the sums reduced over ranks,
  and the peak memory of every GPU (``reset_peak_memory``, ``peak_memory_per_gpu``);
- "is my job alive, and when does it end?": ``StepMeter`` prints rank 0's progress line;
- "is the loader keeping up?": ``StepMeter.wait_s``, the epoch's ``data_wait_frac``;
- "where does a step's time go?": ``StepProfiler`` (--profile) traces a few steps with
  torch.profiler and splits the step into compute, communication not hidden behind compute,
  data wait and the rest (``step_breakdown``);
- "is the network as fast as it should be?": ``collective_check`` (--check) and
  ``bandwidth`` (--profile, world size > 1) time the strategy's collectives the way nccl-tests
  do and print ``[BANDWIDTH]`` lines, with the network that carried them (training/network.py).
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from training import cudagraph, network
from training.contract import (BANDWIDTH_PREFIX, LATER_METRIC_KEYS, PROFILE_KEYS, PROFILE_PREFIX,
                               format_metric_line)
from training.distributed import all_reduce, every_rank, print0, rank_and_world

# --------------------------------------------------------------------------------------------
# The clock and the peak memory
# --------------------------------------------------------------------------------------------


def reset_peak_memory(*devices: torch.device) -> None:
    """Start a new peak on each device, so each epoch reports its own: the CUDA allocator's on a
    GPU, the peak RSS on a CPU (Linux: 5 into /proc/self/clear_refs; elsewhere the run's)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            continue
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory since ``reset_peak_memory``: CUDA ``max_memory_allocated`` on a GPU (at
    least the captured step's, with --cuda-graph), else the peak RSS (VmHWM, or getrusage's
    whole-run figure where /proc is missing)."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(device) / 2**20,
                   cudagraph.captured_peak_mib.get(device.index, 0.0))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def peak_memory_per_gpu(devices: list) -> list:
    """The peak (MiB) of every GPU of the run, in rank order: this process's ``devices`` (DDP
    and FSDP: its one GPU; DataParallel: all of them), gathered from every rank."""
    local = torch.tensor([peak_memory_mib(d) for d in devices], dtype=torch.float64,
                         device=devices[0])
    world = rank_and_world()[1]
    if world == 1:
        return local.tolist()
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)  # collective: every rank's peaks
    return torch.cat(everyone).tolist()


def synchronize(*devices: torch.device) -> None:
    """Wait for the devices' queued work, so the clock measures work done, not work queued."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# The epoch's figures
# --------------------------------------------------------------------------------------------

def epoch_so_far(sums: torch.Tensor, t0: float, wait_s: float, devices: list,
                 earlier: dict | None) -> dict:
    """Collective (every rank), at a checkpoint inside an epoch: the epoch's training figures
    so far, which the checkpoint carries, so that the epoch resumed from it reports the whole
    epoch and not only the steps after the checkpoint (a fourth of the images, a fourth of the
    time: an outlier on every epoch chart). sums: this rank's [loss x n, correct, n]; t0: when
    this process began the epoch; ``earlier``: what the checkpoint it resumed from carried."""
    synchronize(*devices)
    train = all_reduce(sums.clone()).tolist()
    times = torch.tensor([time.perf_counter() - t0, wait_s], device=sums.device,
                         dtype=torch.float64)
    train_time, data_wait = all_reduce(times, dist.ReduceOp.MAX).tolist()
    return with_earlier(dict(train_sums=train, train_time_s=train_time, data_wait_s=data_wait,
                             peaks=peak_memory_per_gpu(devices)), earlier)


def with_earlier(part: dict, earlier: dict | None) -> dict:
    """The figures of an epoch's ``part`` joined to those of its ``earlier`` steps (before the
    checkpoint it resumed from): sums and times add up, each GPU's peak is the larger (at
    another world size, this run's GPUs are other GPUs: only this run's peaks count)."""
    if not earlier:
        return part
    same_gpus = len(earlier["peaks"]) == len(part["peaks"])
    return dict(train_sums=[a + b for a, b in zip(earlier["train_sums"], part["train_sums"])],
                train_time_s=earlier["train_time_s"] + part["train_time_s"],
                data_wait_s=earlier["data_wait_s"] + part["data_wait_s"],
                peaks=[max(a, b) for a, b in zip(earlier["peaks"], part["peaks"])]
                if same_gpus else part["peaks"])


def earlier_images(earlier: dict | None) -> int:
    """The training images of an epoch's steps before the checkpoint it resumed from."""
    return int(earlier["train_sums"][2]) if earlier else 0


def epoch_metrics(totals: list, epoch_time: float, data_wait: float, peaks: list, t0: float,
                  train_time: float, earlier: dict | None = None) -> dict:
    """The measured keys of an epoch's [METRIC] line. totals: the six sums reduced over all
    ranks (train loss x n, correct, n, then the same for validation), so each average is a sum
    divided by a count, never a mean of the ranks' means; epoch_time: the slowest rank's
    training time, data_wait: the longest any rank's loader kept it waiting, both in s; peaks:
    MiB per GPU; t0, train_time: this rank's perf_counter() when training started, and how
    long it took. ``earlier``: the figures of the steps a resumed epoch ran before its
    checkpoint (epoch_so_far), joined in so that the line covers the whole epoch."""
    if earlier:
        whole = with_earlier(dict(train_sums=totals[:3], train_time_s=epoch_time,
                                  data_wait_s=data_wait, peaks=peaks), earlier)
        totals = whole["train_sums"] + totals[3:]
        epoch_time, data_wait, peaks = whole["train_time_s"], whole["data_wait_s"], \
            whole["peaks"]
    t_loss, t_correct, t_n, v_loss, v_correct, v_n = totals
    now, clock = time.perf_counter(), time.time()
    return dict(
        train_loss=t_loss / max(t_n, 1), train_acc=100.0 * t_correct / max(t_n, 1),
        val_loss=v_loss / max(v_n, 1), val_acc=100.0 * v_correct / max(v_n, 1),
        train_images=int(t_n), val_images=int(v_n), epoch_time_s=epoch_time,
        throughput_img_s=t_n / epoch_time if epoch_time > 0 else 0.0,
        peak_mem_mib=max(peaks), peak_mem_per_gpu_mib=peaks,
        data_wait_frac=min(1.0, data_wait / epoch_time) if epoch_time > 0 else 0.0,
        # when training and evaluation ran, in seconds since 1970 on this rank's clock: the
        # epochs on analyze_memory.py's timelines (evaluation ends now)
        train_start_unix=clock - (now - t0), eval_start_unix=clock - (now - t0 - train_time),
        eval_end_unix=clock)


def print_final(metrics: dict, total_time: float, trained: bool) -> None:
    """After the last epoch (rank 0 prints): the final [METRIC] line, the last epoch's metrics
    with final=1 and total_time_s (seconds since this process's first epoch began: training,
    evaluation, checkpoints), then the total time. A run resumed from a checkpoint already past
    --epochs trains nothing: it says so, and its final line repeats the checkpoint's last epoch
    with total_time_s=nan (nothing was timed), so that the study still sees the run end."""
    if not trained:
        print0("nothing to train: the checkpoint is already past --epochs")
    if metrics:
        total = total_time if trained else math.nan
        # a checkpoint written before a key was added to the line resumes without it: nan
        older = dict.fromkeys(LATER_METRIC_KEYS, math.nan)
        print0(format_metric_line(older | metrics | {"total_time_s": total}, final=True))
    if trained:
        print0(f"Total time: {total_time:.1f} s")


# --------------------------------------------------------------------------------------------
# Progress and data wait
# --------------------------------------------------------------------------------------------

def _clock(seconds: float) -> str:
    """A duration as a person reads it: 5:09, 1:05:09."""
    seconds = int(max(0.0, seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StepMeter:
    """The training batches of one epoch, metered: how long the host waited for each next
    batch (``wait_s``: the loader's share of the epoch), and rank 0's progress line after the
    first few steps and then every ``every`` seconds, which answers "is my job alive, and when
    does it end?". It reads only what the host knows (a step count, the clock): no host sync
    is added to the step. On a GPU the host runs a few steps ahead of the device, so the rate
    is that of queued steps; it converges to the real one from the second line on."""

    # An epoch's first line comes once its slow first steps are behind it, or after 10 s when
    # steps are slow (ResNet-50 on a CPU: 6 s a step): the user knows within seconds it runs.
    FIRST_AFTER, FIRST_WITHIN = 3, 10.0  # steps, seconds

    def __init__(self, args, steps: int, images_per_step: int):
        self.every, self.epochs, self.steps = args.log_every, args.epochs, steps
        self.images_per_step = images_per_step
        self.start = time.perf_counter()
        self.epoch_wall = 0.0  # one whole epoch (training, evaluation, saving), once known
        self.wait_s = 0.0

    def epoch(self, batches, epoch: int, start_step: int):
        """Yield ``batches``; ``start_step``: the steps a resumed epoch already ran."""
        now = time.perf_counter()
        if hasattr(self, "epoch_start"):
            self.epoch_wall = now - self.epoch_start
        self.epoch_start, self.wait_s = now, 0.0
        self.next_line = now + min(self.every, self.FIRST_WITHIN)
        it, done, first_line = iter(batches), start_step, True
        while True:
            t = time.perf_counter()
            batch = next(it, None)
            self.wait_s += time.perf_counter() - t  # host time blocked on the loader
            if batch is None:
                return
            if (first_line and done - start_step == self.FIRST_AFTER) or t >= self.next_line:
                self._line(epoch, done, start_step, t)
                first_line = False
            yield batch
            done += 1

    def _line(self, epoch: int, done: int, start_step: int, now: float) -> None:
        self.next_line = now + self.every
        if self.every <= 0 or done >= self.steps:
            return
        elapsed = now - self.epoch_start
        per_step = elapsed / max(1, done - start_step)
        eta_epoch = (self.steps - done) * per_step
        # the rest of the run: this epoch's steps and its evaluation (what a whole epoch took
        # beyond its steps, once one is known), then the remaining epochs
        evaluation = max(0.0, self.epoch_wall - self.steps * per_step)
        eta_run = eta_epoch + evaluation + (self.epochs - epoch - 1) * max(
            self.epoch_wall, self.steps * per_step)
        print0(f"progress: epoch {epoch + 1}/{self.epochs}, step {done}/{self.steps} | "
               f"{(done - start_step) * self.images_per_step / elapsed:.1f} img/s | elapsed "
               f"{_clock(now - self.start)} | ETA epoch {_clock(eta_epoch)}, run "
               f"{_clock(eta_run)}" + ("" if self.epoch_wall else " + evaluation"))


# --------------------------------------------------------------------------------------------
# --profile: where a step's time goes
# --------------------------------------------------------------------------------------------

WAIT_LABEL = "data wait"  # the span StepProfiler marks around each wait for the next batch
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of GPU work
# The host's calls that each put work on the GPU: a kernel, a copy, a fill, or a whole graph
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def _merge(spans) -> list:
    """Intervals (start, end) -> sorted, non-overlapping intervals covering the same time."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _minus(spans: list, cut: list) -> list:
    """The parts of merged ``spans`` that no interval of merged ``cut`` covers."""
    left = []
    for start, end in spans:
        for c_start, c_end in cut:
            if c_end <= start or c_start >= end:
                continue
            if c_start > start:
                left.append([start, c_start])
            start = max(start, c_end)
        if start < end:
            left.append([start, end])
    return left


def _total(spans: list) -> float:
    return sum(end - start for start, end in spans)


def step_breakdown(trace: dict, steps: int, window_s: float, gpu: bool) -> dict:
    """Split the time of ``steps`` profiled steps (``window_s`` seconds of wall time) into
    parts that do not overlap, in milliseconds per step, from a Chrome trace of torch.profiler
    (``gpu``: the steps ran on a GPU):

    compute          GPU: time any non-communication kernel or copy runs; CPU: time the
                     training thread runs an operator, outside the waits for data
    exposed_comm     time a collective runs (GPU: NCCL kernels; CPU: gloo's threads) while no
                     compute does: the communication that overlap with backward did not hide
    data_wait        time the host waited for the next batch (on a GPU: only while the GPU
                     had nothing to do)
    other            the rest: Python, kernel launches, optimizer bookkeeping, idle
    comm             all communication, hidden or not (not one of the parts)
    launches         the host's launch calls per step (LAUNCH_CALLS; 0 on a CPU): about a
                     thousand for an eager ResNet-50 step, a few with --cuda-graph
    """
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and "dur" in e and "ts" in e]

    def spans(keep):
        return _merge((float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                      for e in events if keep(e))

    def is_comm(e):
        name = e.get("name", "").lower()
        return "nccl" in name or name.startswith("gloo:")

    waits = spans(lambda e: e.get("name") == WAIT_LABEL)
    if gpu:  # what the GPU ran; the host's nccl:* spans only launch, gloo's is the stop vote
        comm = spans(lambda e: e.get("cat") in DEVICE_WORK and is_comm(e))
        compute = spans(lambda e: e.get("cat") in DEVICE_WORK and not is_comm(e))
        exposed = _minus(comm, compute)
        wait = _minus(_minus(waits, compute), comm)
    else:  # CPU: the training thread's operators; those inside a wait load data
        comm = spans(is_comm)
        compute = _minus(spans(lambda e: e.get("cat") == "cpu_op"
                               and not e.get("name", "").startswith("c10d::")), waits)
        exposed = _minus(_minus(comm, compute), waits)
        wait = waits
    per_step = 1e-3 / steps  # trace times are microseconds
    parts = dict(compute_ms=_total(compute) * per_step,
                 exposed_comm_ms=_total(exposed) * per_step,
                 data_wait_ms=_total(wait) * per_step)
    step_ms = window_s * 1e3 / steps
    launches = sum(1 for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                   and e.get("name", "").startswith(LAUNCH_CALLS))
    return dict(steps=steps, step_ms=step_ms, **parts,
                other_ms=max(0.0, step_ms - sum(parts.values())),
                comm_ms=_total(comm) * per_step, launches_per_step=launches / steps)


def format_profile_line(parts: dict, trace_path) -> str:
    return (PROFILE_PREFIX + " " + " ".join(
        f"{k}={parts[k]}" if k == "steps" else f"{k}={parts[k]:.3f}" for k in PROFILE_KEYS)
        + f" trace={trace_path}")


class StepProfiler:
    """--profile: rank 0 traces a window of steps of the first epoch it runs (3 warm-up steps,
    then 5; with --cuda-graph the window starts after the capture) with torch.profiler, marks
    each wait for the next batch in the trace, and prints where a step's time went ([PROFILE]
    line) and where the trace is. Other ranks, and runs without --profile, pass the batches
    through untouched."""

    AFTER, STEPS = 3, 5  # skip 3 steps (warm-up), trace 5

    def __init__(self, args, steps: int, device: torch.device):
        self.out_dir = args.profile if rank_and_world()[0] == 0 else None
        self.steps, self.device = steps, device
        if self.out_dir:
            # Kineto leaves CUPTI hooked into every CUDA call after the profiler stops, unless
            # TEARDOWN_CUPTI=1 (PyTorch issue 144455): the steps after the window would run
            # slower than a run without --profile, and the epoch that is timed is one of them.
            # Kineto reads the variable as a profiler stops and starts, so it is set before the
            # first one is made; a value the user set is kept. One window a run, so CUPTI is
            # never set up again after its teardown, which is what crashed with CUDA graphs
            # before CUDA 12.6 (where torch.compile's graphs run, torch's profiler sets it to 0).
            os.environ.setdefault("TEARDOWN_CUPTI", "1")
        # --cuda-graph: the eager steps, the capture and a first replay come before the window
        self.graph = bool(args.cuda_graph)
        self.after = self.AFTER + (cudagraph.DDP_WARMUP_STEPS if self.graph else 0)

    def epoch(self, batches, start_step: int):
        """Yield ``batches`` (``start_step``: the steps a resumed epoch already ran), tracing
        this epoch's window of steps, if it has one."""
        start, end = self._window(start_step)
        it, done, profile = iter(batches), start_step, None
        while True:
            if done == start:
                profile = _Trace(self.out_dir, self.device, end - start)
            elif done == end:
                profile.finish()
                profile = self.out_dir = None  # one window per run
            with torch.profiler.record_function(WAIT_LABEL) if profile else nullcontext():
                batch = next(it, None)
            if batch is None:
                return
            yield batch
            done += 1

    def _window(self, start_step: int) -> tuple:
        """(first, end) step of this epoch's window; (-1, -1): none."""
        n = self.steps - start_step
        if not self.out_dir or n < 1:
            return -1, -1
        if self.graph:  # never the eager steps or the capture: they are not what runs
            start = start_step + self.after
            if start >= self.steps:
                print0(f"note: --profile with --cuda-graph: this epoch's {n} step(s) end before "
                       f"the capture and a first replay ({self.after} steps): nothing is "
                       f"traced; epochs of {self.after + self.STEPS} steps or more are")
                self.out_dir = None
                return -1, -1
        else:
            start = start_step + min(self.after, n // 3)
        end = min(start + self.STEPS, self.steps)
        if (start - start_step, end - start) != (self.after, self.STEPS):
            print0(f"note: --profile: this epoch runs {n} step(s), so it traces {end - start} "
                   f"after {start - start_step} warm-up step(s), not {self.STEPS} after "
                   f"{self.after}: a longer epoch gives steadier figures")
        return start, end


class _Trace:
    """torch.profiler over a window of steps on rank 0, then the breakdown and the trace."""

    def __init__(self, out_dir, device: torch.device, steps: int):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if device.type == "cpu":  # kineto's "no GPU" error on a CPU run is noise
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self.device, self.steps = device, steps
        self.path = Path(out_dir) / "profile_trace_rank0.json"
        self.profiler = torch.profiler.profile(activities=activities)
        synchronize(device)  # the window starts with an idle device
        self.profiler.start()
        self.t0 = time.perf_counter()

    def finish(self) -> None:
        synchronize(self.device)
        window_s = time.perf_counter() - self.t0
        self.profiler.stop()
        self.profiler.export_chrome_trace(str(self.path))
        with open(self.path) as f:
            parts = step_breakdown(json.load(f), self.steps, window_s,
                                   gpu=self.device.type == "cuda")
        print0(format_profile_line(parts, self.path))
        hidden = 1 - parts["exposed_comm_ms"] / parts["comm_ms"] if parts["comm_ms"] else 1.0
        print0(f"profile: {parts['step_ms']:.1f} ms per step = compute {parts['compute_ms']:.1f}"
               f" + exposed communication {parts['exposed_comm_ms']:.1f} + data wait "
               f"{parts['data_wait_ms']:.1f} + other {parts['other_ms']:.1f} (communication "
               f"{parts['comm_ms']:.1f} ms, {hidden:.0%} of it hidden behind compute); open "
               f"{self.path} in https://ui.perfetto.dev")


# --------------------------------------------------------------------------------------------
# --check: the bandwidth of the collectives
# --------------------------------------------------------------------------------------------

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


def bandwidth(device: torch.device, world: int, sizes: list, ops=("all_reduce",),
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
    sizes = bandwidth(device, world, [grad_bytes // d for d in (64, 16, 4, 1)], ops)
    print0(f"check: bandwidth measured up to {sizes[-1] / 2**20:.1f} MiB, the model's gradient "
           f"size (busbw: the figure to compare with the links' nominal bandwidth)")
