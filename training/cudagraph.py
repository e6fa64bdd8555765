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
"""

from __future__ import annotations

import contextlib

import torch

from training.common import print0
from training.faults import UsageError

# Eager steps before the capture: 3 in PyTorch's whole-network example; DDP needs at least 11
# (its first 10 iterations time themselves with CUDA events that a capture cannot hold).
WARMUP_STEPS = 3
DDP_WARMUP_STEPS = 11


def check(args, device: torch.device, strategy: str) -> None:
    """One sentence, exit 2, for every setup --cuda-graph cannot capture."""
    if not getattr(args, "cuda_graph", False):
        return
    if strategy == "fsdp":
        raise UsageError("--cuda-graph cannot capture FSDP's step: FSDP2 allocates and frees "
                         "each block's gathered parameters (storage resizes) in every forward and "
                         "backward, which a replayed graph cannot repeat; drop --cuda-graph, or "
                         "use ddp_train.py --cuda-graph")
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

    def stream(self):
        """Build DDP in this context: on the capture stream with --cuda-graph."""
        return torch.cuda.stream(self.side) if self.enabled else contextlib.nullcontext()

    def wrap(self, step, optimizer):
        """``step(images, labels) -> (outputs, loss)``, captured with --cuda-graph."""
        return CapturedStep(step, optimizer, self.side, self.warmup) if self.enabled else step


class CapturedStep:
    """Calls ``step(images, labels)`` eagerly on ``side`` for ``warmup`` steps, then captures
    it into a CUDA graph and replays that graph for this and every later step. Returns the
    step's (outputs, loss): after the capture the graph's own tensors, rewritten by every
    replay, so they are read before the next step (the scripts add them to their sums)."""

    def __init__(self, step, optimizer, side: torch.cuda.Stream, warmup: int):
        self.step, self.optimizer, self.side, self.warmup = step, optimizer, side, warmup
        self.eager_steps = 0
        self.graph = None
        self.images = self.labels = self.outputs = None
        self.lrs = []  # the learning rate of each parameter group, on the device

    def __call__(self, images: torch.Tensor, labels: torch.Tensor):
        if self.graph is None:
            if self.eager_steps < self.warmup:
                self.eager_steps += 1
                return self._on_side_stream(images, labels)
            self._capture(images, labels)
        if images.shape != self.images.shape or labels.shape != self.labels.shape:
            raise RuntimeError(f"--cuda-graph replays a step captured for batches of shape "
                               f"{tuple(self.images.shape)}, got {tuple(images.shape)}: every "
                               f"training batch must have the same size")
        self.images.copy_(images, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        for lr, group in zip(self.lrs, self.optimizer.param_groups):
            lr.fill_(group["lr"])  # the scheduler's rate for this step (a launch, no sync)
        self.graph.replay()
        return self.outputs

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
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"--cuda-graph: capturing the training step failed ({first}); "
                             f"drop --cuda-graph to train eagerly") from None
        finally:
            for group, rate in zip(groups, rates):  # schedulers and checkpoints see floats
                group["lr"] = rate
        torch.cuda.current_stream().wait_stream(self.side)
        print0(f"cuda graph: the training step was captured after {self.eager_steps} eager "
               f"steps; every later step replays it (one launch)")
