"""--profile: where a training step's time goes. ``StepProfiler`` traces a window of steps on
rank 0 with torch.profiler, marking each wait for the next batch; ``step_breakdown`` splits the
traced steps into compute, communication not hidden behind compute, data wait and the rest,
and rank 0 prints them as the ``[PROFILE]`` line (``format_profile_line``) and a sentence.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from training import cudagraph
from training.contract import PROFILE_KEYS, PROFILE_PREFIX
from training.distributed import print0, rank_and_world
from training.measure import synchronize

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


def format_profile_sentence(parts: dict, trace_path) -> str:
    """The [PROFILE] line in words, with how much of the communication compute hid."""
    comm = parts["comm_ms"]
    hidden = (f"communication {comm:.1f} ms, "
              f"{1 - parts['exposed_comm_ms'] / comm:.0%} of it hidden behind compute"
              if comm else "no communication")
    return (f"profile: {parts['step_ms']:.1f} ms per step = compute {parts['compute_ms']:.1f}"
            f" + exposed communication {parts['exposed_comm_ms']:.1f} + data wait "
            f"{parts['data_wait_ms']:.1f} + other {parts['other_ms']:.1f} ({hidden}); open "
            f"{trace_path} in https://ui.perfetto.dev")


class StepProfiler:
    """--profile: rank 0 traces a window of steps of the first epoch it runs (3 warm-up steps,
    then 5; with --cuda-graph the window starts after the capture) with torch.profiler, marks
    each wait for the next batch in the trace, and prints where a step's time went ([PROFILE]
    line) and where the trace is. Other ranks, and runs without --profile, pass the batches
    through untouched."""

    AFTER, STEPS = 3, 5  # skip 3 steps (warm-up), trace 5

    def __init__(self, out_dir: str | None, cuda_graph: bool, steps: int, device: torch.device):
        """``out_dir``: --profile's DIR (None: no window); ``cuda_graph``: --cuda-graph."""
        self.out_dir = out_dir if rank_and_world()[0] == 0 else None
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
        self.graph = cuda_graph
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
            # a short epoch keeps a third of its steps for the warm-up at most, fewer only
            # where the whole window would not fit after it
            start = start_step + min(self.after, max(n // 3, n - self.STEPS))
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
        print0(format_profile_sentence(parts, self.path))
