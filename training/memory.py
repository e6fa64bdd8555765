"""The memory model: what one GPU holds during a training step, by component, predicted before
the run (``--estimate-memory``, and the ``[MEMORY]`` line every run prints at its start) and
compared with the measured peak by collect_results.py.

What a step keeps on one GPU, and how each part is counted here:

- **parameters, gradients, optimizer state, buffers**: counted from the model itself, in
  bytes, then divided the way the strategy divides them (each script's ``memory_per_gpu``);
  SGD with momentum keeps one momentum buffer per parameter;
- **activations**: every tensor the forward saves for backward. They are counted exactly, on
  the CPU, with ``torch.autograd.graph.saved_tensors_hooks``: one forward at batch 2 and one at
  batch 4, each storage counted once, parameters and buffers left out. The count is linear in
  the batch (checked in tests/test_memory.py), so the two forwards give it at any batch: a
  part per image and a part that does not grow with the batch (under --amp, that part is
  mostly the weights autocast casts to 16 bits: ``amp_copies``);
- **workspace**: what a GPU step allocates beside the tensors counted here: cuBLAS's and
  cuDNN's workspaces, the weight gradients of the backward before they are added to ``.grad``,
  the caching allocator's rounding. Not counted from the model but measured (``WORKSPACE``).
  The peak is where the backward starts: a replay of the backward on the CPU that follows
  every storage (``bench/memory_check.py --backward``) finds the backward's most 6 MiB above
  what the forward saved (ResNet-50, batch 256), since the gradient of a large early
  activation comes when the later ones are freed;
- **communication buffers**: DDP's gradient buckets, FSDP's unsharded parameters and
  gradients of the blocks in flight, DataParallel's whole batch and gathered outputs on GPU 0;
- **data** (``--data-on-device``): what the rank's DeviceResident loaders hold on the GPU,
  in the dtype stored (``data_and_inputs`` says what that is for each kind of data);
- **inputs**: the input batches the step holds at its peak: the loader's batch being trained
  on and the next one, copied ahead while the step computes, as the loader hands them over,
  and the batch finished on the device (normalised, in float32) that the model gets.

Not counted, and stated with every table: the caching allocator's fragmentation, and the CUDA
context (about 0.5 GB that nvidia-smi sees and ``torch.cuda.max_memory_allocated`` does not).
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from training import contract, datasets, flags, loading, models, tinyimagenet
from training.distributed import print0
from training.faults import UsageError

MIB = 2**20
CACHE_IMAGE = 64 * 64 * 3  # bytes of one image of the TinyImageNet cache (uint8 HWC)
COUNT_BATCHES = (2, 4)  # the two forwards; 2, not 1: BatchNorm needs two values per channel
# What a ResNet-50 step allocated on an H200 (torch 2.11, cuDNN 9.19) beside every counted
# component: the median over the 9 configurations of eager rows (64 and 224 pixels, batch 256
# to 2048, DDP, FSDP, DataParallel, bf16 and fp16) of the measured peak minus the prediction
# without it (bench/results/gpu-h200-memory-2026-11-28.md; bench/memory_check.py prints it).
WORKSPACE = 86 * MIB


@dataclass
class Saved:
    """What one forward saves for backward, for images of ``input_shape`` under ``amp``: bytes
    per image, and bytes that do not grow with the batch."""
    per_image: float
    fixed: float
    input_shape: tuple
    amp: str
    outputs_per_image: int  # the numbers the model returns per image (its classes)


def count_saved(model: nn.Module, input_shape: tuple, batch: int, amp: str) -> tuple:
    """One forward of ``model`` (train mode, on the CPU) at ``batch``: (bytes of every tensor
    it saves for backward, each storage once, without parameters and buffers; the numbers the
    model returns per image). Under --amp fp16 or bf16 the forward runs under CPU autocast in
    bf16: the same two bytes per element as fp16 on a GPU."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    images = torch.randn(batch, *input_shape)
    with saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp != "off"):
        outputs = model(images)
    per_image = outputs.numel() // batch
    del outputs  # frees the graph, and the storages with it
    return sum(saved.values()), per_image


def saved_for_backward(model: nn.Module, input_shape: tuple, amp: str) -> Saved:
    """The activations of ``model`` at any batch, from two counted forwards (COUNT_BATCHES) on
    a CPU copy of it: the model itself, its BatchNorm statistics and the random state stay as
    they were."""
    twin = copy.deepcopy(model).cpu().train()
    small, large = COUNT_BATCHES
    # Dropout and the random images draw from a forked generator, so the model's own random
    # state stays as it was.
    with torch.random.fork_rng(devices=[]):
        (a, _), (b, outputs) = (count_saved(twin, input_shape, n, amp) for n in COUNT_BATCHES)
    per_image = (b - a) / (large - small)
    return Saved(per_image, a - per_image * small, tuple(input_shape), amp, outputs)


def param_bytes(tensors) -> int:
    """Bytes of ``tensors`` (parameters, or buffers) as they are stored."""
    return sum(t.numel() * t.element_size() for t in tensors)


def shard_rows(rows: int, world: int, rank: int) -> int:
    """The rows of a tensor's dim 0 that ``rank`` holds when FSDP2 shards it over ``world``
    ranks: torch.chunk's split, ceil(rows / world) each, the last ranks less or none."""
    each = -(-rows // world)
    return max(0, min(each, rows - rank * each))


def fsdp_shard_bytes(params, world: int, rank: int = 0) -> int:
    """Bytes of ``rank``'s FSDP2 shards of ``params``. Rank 0's is also what every rank
    allocates: FSDP2 pads each shard to ceil(rows / world) rows."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        total += shard_rows(rows, world, rank) * (p.numel() // max(rows, 1)) * p.element_size()
    return total


def zero1_partition(params, world: int) -> list:
    """The parameters each rank optimizes under ZeroRedundancyOptimizer: largest first, each
    to the rank with the fewest elements so far (torch's own greedy rule)."""
    ranks, sizes = [[] for _ in range(world)], [0] * world
    for p in sorted(params, key=lambda t: t.numel(), reverse=True):
        r = sizes.index(min(sizes))
        ranks[r].append(p)
        sizes[r] += p.numel()
    return ranks


@dataclass
class Estimate:
    """One process's (one GPU's) predicted memory, in bytes, by component: the model states
    and communication buffers as the strategy holds them, the activations from ``saved`` at
    ``per_gpu_batch``."""
    strategy: str
    variant: str  # "-", or the strategy's option: zero1, full, grad-op, offload, ...
    world_size: int
    per_gpu_batch: int
    saved: Saved
    params: float
    grads: float
    optimizer: float
    buffers: float
    comm: float
    host: float = 0.0  # kept in host memory instead (--offload)
    data: float = 0.0  # --data-on-device: the data the rank holds on the GPU
    inputs: float = 0.0  # the input batches in flight at the peak
    grads_at_peak: bool = True  # False when they are freed before each step, made in backward
    weights_cast: bool = True  # False when the weights reach autocast in its dtype already
    notes: list = field(default_factory=list)

    @property
    def activations(self) -> float:
        return self.saved.per_image * self.per_gpu_batch

    @property
    def amp_copies(self) -> float:
        """Saved tensors that do not grow with the batch: under --amp, the weights autocast
        casts to 16 bits (and BatchNorm's per-channel statistics); none where the strategy
        hands autocast 16-bit weights (FSDP's param_dtype), which it does not copy."""
        return self.saved.fixed if self.weights_cast else 0.0

    @property
    def workspace(self) -> float:
        """What the step allocates beside the counted tensors (measured: WORKSPACE)."""
        return WORKSPACE

    @property
    def peak(self) -> float:
        """The components that are all resident at once, as the backward starts."""
        return (self.params + self.optimizer + self.buffers + self.amp_copies + self.activations
                + self.comm + self.workspace + self.data + self.inputs
                + (self.grads if self.grads_at_peak else 0))

    def values(self) -> dict:
        sizes = dict(params=self.params, grads=self.grads, optimizer=self.optimizer,
                     buffers=self.buffers, amp_copies=self.amp_copies,
                     activations=self.activations, comm=self.comm, workspace=self.workspace,
                     data=self.data, inputs=self.inputs, host=self.host, peak=self.peak)
        return dict(strategy=self.strategy, variant=self.variant, world_size=self.world_size,
                    per_gpu_batch=self.per_gpu_batch, image_size=self.saved.input_shape[-1],
                    amp=self.saved.amp) | {f"{k}_mib": round(v / MIB, 1) for k, v in sizes.items()}

    def line(self) -> str:
        """The machine line: ``[MEMORY] strategy=... peak_mib=...`` (contract.MEMORY_KEYS)."""
        values = self.values()
        return contract.MEMORY_PREFIX + " " + " ".join(f"{k}={values[k]}"
                                                       for k in contract.MEMORY_KEYS)


def train_samples(args) -> int:
    """The training samples of the run's data: --synthetic-size, or the TinyImageNet cache's
    count, read from its labels file (the only data --data-on-device can hold)."""
    if args.dataset == "synthetic":
        return args.synthetic_size
    labels = tinyimagenet.cache_dir(args.data_dir, args.data_cache) / "train_labels.npy"
    if not labels.is_file():
        raise UsageError(f"--data-on-device's data are counted from the cache, and {labels} is "
                         f"not there yet: build it first (python prepare_tinyimagenet.py "
                         f"{args.data_dir} {labels.parent}) or drop --data-on-device")
    return len(np.load(labels, mmap_mode="r"))


def data_and_inputs(args, processes: int, loader_batch: int, model_batch: int) -> tuple:
    """(data, inputs): the bytes one GPU holds of the data and of the input batches at the
    peak, on a GPU, with the batches DeviceResident or the DataLoader hands over (the same
    samples either way). ``processes``: the ranks the training set is split over;
    ``loader_batch``: one batch of the loader (DataParallel's is the global batch);
    ``model_batch``: the images of it that the GPU's model copy trains on.

    data, with --data-on-device only (DeviceResident says what it holds, in ``held``):
    synthetic data: the class prototypes (uint8, C x H x W each) and the noise field (int16,
    C x H x W + NOISE_SHIFTS values) of the training and of the validation split, and the
    epoch's samples of this rank as a noise offset and a label each (int64), its batches made
    from them as they are used; the TinyImageNet cache: this rank's training samples of the epoch,
    N // processes rounded down to whole batches (at most loading.held_batches of them), uint8
    64 x 64 x 3 and an int64 label each. The validation samples are held during evaluation
    only, when no activations are kept for backward; not counted, they may outweigh a
    training shard that a small --max-steps-per-epoch keeps small.

    inputs: two loader batches, the one the step trains on and the next, which to_device copies
    (or DeviceResident makes) while the step computes, as the loader hands them over (uint8 for
    the cache and synthetic data, float32 otherwise; int64 labels), none for the cache held on
    the device, whose batches are views of its shard; under --amp the float32 batch the model
    gets (with --amp off the first layer saves that batch for backward: an activation); and
    with --cuda-graph the graph's own copy of that batch and its labels, which every replay
    reads (cudagraph.StepCapture: 147 MiB at 224 px, batch 256)."""
    shape, classes = flags.input_shape(args)
    image = math.prod(shape)
    cache = args.dataset == "tinyimagenet" and bool(args.data_cache)
    stored = CACHE_IMAGE if cache else image if args.dataset == "synthetic" else 4 * image
    data = 0
    if args.data_on_device:
        batches = train_samples(args) // processes // loader_batch
        samples = min(batches, loading.held_batches(args) or batches) * loader_batch
        noise = 2 * (image + datasets.SyntheticImages.NOISE_SHIFTS)  # int16
        data = samples * (stored + 8) if cache else 2 * (classes * image + noise) + samples * 16
    in_flight = 0 if args.data_on_device and cache else 2 * loader_batch * (stored + 8)
    finished = model_batch * image * 4 if args.amp != "off" else 0
    static = model_batch * (image * 4 + 8) if getattr(args, "cuda_graph", False) else 0
    return data, in_flight + finished + static


def model_states(model: nn.Module, momentum: float) -> tuple:
    """(parameters, gradients, optimizer state, buffers) of the whole model, in bytes: fp32
    gradients like the parameters, one SGD momentum buffer per parameter (none without
    momentum)."""
    params = param_bytes(model.parameters())
    return params, params, params if momentum else 0, param_bytes(model.buffers())


COLUMNS = (("params", "params"), ("grads", "grads"), ("optimizer", "optim"),
           ("buffers", "buffers"), ("amp_copies", "amp copies"), ("activations", "activations"),
           ("comm", "comm"), ("workspace", "workspace"), ("data", "data"),
           ("inputs", "inputs"), ("peak", "peak"), ("host", "host"))


def table(estimates: list) -> list:
    """The lines of a table a person reads: one row per estimate, MiB per GPU. A column is 12
    characters wide, or wider where a figure needs it (a batch of millions)."""
    names = [e.strategy if e.variant == "-" else f"{e.strategy} {e.variant}" for e in estimates]
    cells = [[f"{e.values()[key + '_mib']:,.0f}" + ("*" if key == "grads" and not e.grads_at_peak
                                                     else "") for key, _ in COLUMNS]
             for e in estimates]
    widths = [max([12] + [len(row[i]) + 2 for row in cells]) for i in range(len(COLUMNS))]
    name_width = max([16] + [len(name) + 2 for name in names])
    gpus_width = max([5] + [len(str(e.world_size)) + 1 for e in estimates])
    head = f"{'strategy':<{name_width}}{'GPUs':>{gpus_width}}" + "".join(
        f"{title:>{width}}" for (_, title), width in zip(COLUMNS, widths))
    rows = [head, "-" * len(head)]
    for name, e, row in zip(names, estimates, cells):
        rows.append(f"{name:<{name_width}}{e.world_size:>{gpus_width}}" + "".join(
            f"{cell:>{width}}" for cell, width in zip(row, widths)))
    return rows


UNCOUNTED = ("not counted: allocator fragmentation and the CUDA context (about 0.5 GB, which "
             "nvidia-smi shows and torch.cuda.max_memory_allocated does not)")


def print_estimates(estimates: list, model_name: str) -> None:
    """--estimate-memory's output: the [MEMORY] lines, then the table and what it assumes."""
    for e in estimates:
        print0(e.line())
    saved, side = estimates[0].saved, estimates[0].saved.input_shape[-1]
    print0(f"\nPredicted memory per GPU (MiB): {model_name} at {side}x{side}, batch "
           f"{estimates[0].per_gpu_batch} per GPU, --amp {saved.amp}")
    for row in table(estimates):
        print0(row)
    print0(f"activations: {saved.per_image / MIB:.2f} MiB per image saved for backward, counted "
           f"with saved-tensor hooks in two forwards on the CPU (batch {COUNT_BATCHES[0]} and "
           f"{COUNT_BATCHES[1]}; linear in the batch)")
    print0("data: what --data-on-device holds on each GPU (synthetic: the class prototypes, "
           "a noise field, and the epoch's samples as a noise offset and a label each; the "
           "cache: the rank's samples of the epoch, uint8); inputs: the batch trained on and "
           "the next one, as the loader hands them over, and under --amp the float32 batch "
           "the model gets")
    print0(f"workspace: cuBLAS's and cuDNN's workspaces and the backward's temporaries beside "
           f"the counted tensors, measured with ResNet-50 on an H200: {WORKSPACE / MIB:.0f} MiB")
    print0("peak: every column left of it that is resident at once, as the backward starts"
           + ("; * gradients are freed before each step and made during backward, as "
              "activations are freed" if any(not e.grads_at_peak for e in estimates) else ""))
    notes = dict.fromkeys(n for e in estimates for n in e.notes)
    for note in notes:
        print0(f"note: {note}")
    print0(UNCOUNTED)


def gpu_counts(flag) -> list:
    """The GPU counts --estimate-memory N asks for: N, or 1, 2, 4 and 8."""
    return list(flags.ALL_GPU_COUNTS) if flag == flags.ALL_GPU_COUNTS else [flag]


def estimate_only(args, memory_per_gpu, variants: tuple) -> int:
    """--estimate-memory: the model built on the CPU, its activations counted once, then one
    estimate per variant and GPU count from the script's ``memory_per_gpu``. No GPU, no process
    group, no dataset."""
    gpus = getattr(args, "gpus", None)  # dp_train.py's own flag; the counts are this one's
    if gpus:
        counts = ("1, 2, 4 and 8" if args.estimate_memory == flags.ALL_GPU_COUNTS
                  else args.estimate_memory)
        print0(f"note: --gpus {gpus} does nothing with --estimate-memory, which predicts for "
               f"{counts} GPU(s): for {gpus}, use --estimate-memory {gpus} and drop --gpus")
    shape, classes = flags.input_shape(args)
    if args.amp is None:  # what a GPU run picks (both 16-bit types save the same bytes)
        # a copy with it: the run's flags stay as parsed and resolved, never changed here
        args = argparse.Namespace(**vars(args) | {"amp": "bf16"})
        print0("note: --amp bf16 assumed, a GPU run's default (fp16 saves the same bytes; "
               "--amp off for fp32)")
    torch.manual_seed(args.seed)
    model = models.build_model(args.model, classes, shape, args.batch_size)
    saved = saved_for_backward(model, shape, args.amp)
    estimates = [memory_per_gpu(model, args, n, saved, variant)
                 for variant in variants for n in gpu_counts(args.estimate_memory)]
    print_estimates(estimates, args.model)
    return 0
