"""--cuda-graph: the whole training step (forward, backward with DDP's all-reduce, the optimizer
step) captured once as a CUDA graph and replayed for every later batch.

Why: on a fast GPU at a workshop's batch sizes the host sets the pace, not the GPU. A ResNet-50
step is about a thousand kernels, each launched by Python for about 20 us; on an H200 at 64 x 64
pixels the step took 21 ms at batch 256 and at batch 1024 alike, so at 256 the GPU idled three
quarters of the time. A replayed graph is one launch: the GPU runs the step's kernels back to
back, and the host is free at once.

How (PyTorch's "whole-network capture", in its CUDA semantics notes):
- the first steps (WARMUP_STEPS, DDP_WARMUP_STEPS) run eagerly on a side stream, as real
  training steps: cuDNN picks its kernels, the GradScaler makes its scale, DDP rebuilds its
  gradient buckets;
- the next step is captured on that stream from static input buffers, then replayed; every
  later step copies its batch into those buffers and replays the graph;
- the learning rate is the one number the host changes between steps: in the graph the
  optimizer reads it from a device tensor, which the host sets before each replay;
- nothing in the step may wait for the host (.item(), printing a tensor): the scripts keep their
  sums on the device, and the fused optimizer lets the GradScaler skip an overflowing step
  without reading its inf flag.
DDP must be built on the stream the step is captured on (``stream()``): it keeps each
parameter's gradient accumulator, which runs on the stream it was made on.

What changes: the step's memory lives in the graph's own pool, so the peak the scripts report
is the captured step's (``captured_peak_mib``, which measure.peak_memory_mib reads); a batch
with fewer images (an unreadable image skipped on the folder path) is padded to the captured
size with repeats of its own images; NCCL's watchdog does not time a collective inside a
replay, so a dead peer is noticed at the next collective outside the graph (the epoch's
metric reduction), not by the replay.
"""

from __future__ import annotations

import contextlib

import torch

from training.distributed import print0
from training.faults import UsageError

# --cuda-graph: the peak of the captured step, per device. A replay allocates nothing (its
# tensors live in the graph's own pool), so after the capture max_memory_allocated no longer
# sees the step's activations; this floor keeps them in every later epoch's peak.
captured_peak_mib: dict = {}

# --compile modes whose compiled steps torch records and replays as CUDA graphs (CUDA graph
# trees): their replays allocate nothing either, so an epoch after the one that recorded them
# keeps that epoch's peak as its floor (measured on an H200: 966 MiB reported for a 224 px
# step that holds about 11 GB, before the floor)
COMPILE_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def keep_peak(device: torch.device) -> None:
    """Keep the peak since the last reset on ``device`` as the floor of later peaks: called
    before a reset in a run whose compiled step replays CUDA graphs."""
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    captured_peak_mib[device.index] = max(captured_peak_mib.get(device.index, 0.0), peak)


# Eager steps before the capture: 3 in PyTorch's whole-network example; DDP needs at least 11
# (its first 10 iterations time themselves with CUDA events that a capture cannot hold).
WARMUP_STEPS = 3
DDP_WARMUP_STEPS = 11


def check(args, device: torch.device) -> None:
    """One sentence, exit 2, for every setup --cuda-graph cannot capture (fsdp_train.py
    refuses the flag itself, flags.refuse_flags: FSDP's step cannot be captured)."""
    if not getattr(args, "cuda_graph", False):
        return
    if getattr(args, "zero1", False):
        raise UsageError("--cuda-graph cannot capture --zero1's step: ZeroRedundancyOptimizer "
                         "decides in Python which rank broadcasts which parameters; drop one of "
                         "--cuda-graph and --zero1")
    if device.type != "cuda":
        why = "--device cpu was given" if args.device == "cpu" else "no GPU is visible"
        raise UsageError(f"--cuda-graph captures GPU kernels, and {why}: drop --cuda-graph to "
                         f"train on the CPU")


class StepCapture:
    """The training step, eager (disabled: ``wrap`` returns it unchanged) or captured once and
    replayed (--cuda-graph). ``stream()`` is the context to build DDP in."""

    def __init__(self, enabled: bool, warmup: int = WARMUP_STEPS):
        self.enabled, self.warmup = enabled, warmup
        self.side = torch.cuda.Stream() if enabled else None

    @contextlib.contextmanager
    def stream(self):
        """Build DDP in this context: on the capture stream with --cuda-graph, after the work
        queued so far (the model's move to the device), and before any that follows."""
        if not self.enabled:
            yield
            return
        current = torch.cuda.current_stream()
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            yield
        current.wait_stream(self.side)

    def wrap(self, step, optimizer, ddp=None):
        """``step(images, labels) -> (outputs, loss)``, captured with --cuda-graph. ``ddp``:
        the DDP module, told after each replay what its own forward would have set."""
        if not self.enabled:
            return step
        return CapturedStep(step, optimizer, self.side, self.warmup, ddp)


class CapturedStep:
    """Calls ``step(images, labels)`` eagerly on ``side`` for ``warmup`` steps, then captures
    it into a CUDA graph and replays that graph for this and every later step. Returns the
    step's (outputs, loss): after the capture the graph's own tensors, rewritten by every
    replay, so they are read before the next step (the scripts add them to their sums)."""

    def __init__(self, step, optimizer, side: torch.cuda.Stream, warmup: int, ddp=None):
        self.step, self.optimizer, self.side, self.warmup = step, optimizer, side, warmup
        self.ddp = ddp
        self.eager_steps = 0
        self.padded_note = False
        self.batch = 0  # images per step, as captured
        self.graph = None
        self.images = self.labels = self.outputs = None
        self.lrs = []  # the learning rate of each parameter group, on the device

    def __call__(self, images: torch.Tensor, labels: torch.Tensor):
        n = len(labels)
        if self.graph is None:
            self.batch = max(self.batch, n)  # the full batch, as the warm-up saw it
            if self.eager_steps < self.warmup:
                self.eager_steps += 1
                return self._on_side_stream(images, labels)
        images, labels = self._fill(images, labels)
        if self.graph is None:
            self._capture(images, labels)
        self.images.copy_(images, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        for lr, group in zip(self.lrs, self.optimizer.param_groups):
            lr.fill_(group["lr"])  # the scheduler's rate for this step (a launch, no sync)
        self.graph.replay()
        if self.ddp is not None:  # as DDP's own forward with gradients sets it: the next
            self.ddp.require_forward_param_sync = True  # forward (evaluation) syncs buffers
        outputs, loss = self.outputs
        return outputs[:n], loss

    def _fill(self, images, labels):
        """The batch at the captured size: one with fewer images (the loader skipped
        unreadable ones) gets repeats of its own, so every rank replays the same graph."""
        n = len(labels)
        shape = tuple(self.images.shape[1:]) if self.images is not None else None
        if n == 0 or n > self.batch or shape not in (None, tuple(images.shape[1:])):
            raise RuntimeError(f"--cuda-graph replays a step captured for batches of "
                               f"{self.batch} x {shape}, got {tuple(images.shape)}")
        if n == self.batch:
            return images, labels
        if not self.padded_note:
            print0(f"note: --cuda-graph: a batch of {n} images (the rest unreadable) is filled "
                   f"to the captured {self.batch} with repeats of its own")
            self.padded_note = True
        index = torch.arange(self.batch, device=labels.device) % n
        return images[index], labels[index]

    def _on_side_stream(self, images, labels):
        current = torch.cuda.current_stream()
        self.side.wait_stream(current)  # the batch is ready, the last step's readers are done
        with torch.cuda.stream(self.side):
            result = self.step(images, labels)
        current.wait_stream(self.side)
        return result

    def _capture(self, images, labels) -> None:
        """Record one step: nothing runs on the GPU until the first replay."""
        self.images, self.labels = images.clone(), labels.clone()
        groups = self.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        self.lrs = [torch.tensor(float(rate), dtype=torch.float32, device=images.device)
                    for rate in rates]
        for group, lr in zip(groups, self.lrs):  # the graph reads the rate from the device
            group["lr"] = lr
        self.graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream())
        try:
            # thread_local: the DataLoader's pin-memory thread may allocate while we capture
            with torch.cuda.graph(self.graph, stream=self.side, capture_error_mode="thread_local"):
                self.outputs = self.step(self.images, self.labels)
        except RuntimeError as e:  # the first cause, not the capture's own ending error
            cause = e.__context__ if isinstance(e.__context__, Exception) else e
            first = (str(cause).strip() or type(cause).__name__).splitlines()[0]
            raise UsageError(f"--cuda-graph: capturing the training step failed ({first}); "
                             f"drop --cuda-graph to train eagerly") from e
        finally:
            for group, rate in zip(groups, rates):  # schedulers and checkpoints see floats
                group["lr"] = rate
        torch.cuda.current_stream().wait_stream(self.side)
        # what the captured step holds at its peak, which no replay will allocate again
        device = images.device.index
        captured_peak_mib[device] = torch.cuda.max_memory_allocated(device) / 2**20
        print0(f"cuda graph: the training step was captured after {self.eager_steps} eager "
               f"steps; every later step replays it (one launch)")
