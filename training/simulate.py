"""--simulate-world-size N: what one GPU of N holds, measured with one process.

The process joins torch's fake process group as rank 0 of N (training/distributed.py): every
collective returns at once and moves no data, but every FSDP shard, ZeRO-1 partition and DDP
bucket has the size it has on a real GPU of N. ``report`` trains two steps (the gradients and
the momentum then exist) and prints one ``[MEMORY-HELD]`` line (contract.MEMORY_HELD_KEYS),
counted from the live tensors: the parameters, gradients and optimizer state this rank holds,
where --offload keeps them in host memory, how many FSDP units were unsharded at once, and on
a GPU the peak the steps allocated. The weights it trains are meaningless (no peer ever sends
its part), so it prints no accuracy and saves nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from training import contract, loading, memory
from training.distributed import print0
from training.measure import synchronize

STEPS = 2


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # imported here, where it is used: DTensor's package takes about 1 s to load, which a
    # refusal of a flag or a --help need not wait for
    from torch.distributed.tensor import DTensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor  # FSDP's shards


def held(model: nn.Module, optimizer) -> dict:
    """Bytes this rank holds: its parameters (FSDP: its shards), their gradients and the
    optimizer's state (ZeRO-1: its partition's)."""
    params = list(model.parameters())
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local SGD
    state = [_local(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return dict(params=memory.param_bytes(_local(p) for p in params),
                grads=memory.param_bytes(_local(p.grad) for p in params if p.grad is not None),
                optimizer=memory.param_bytes(state))


def _gathered(unit: nn.Module) -> bool:
    """Whether ``unit``'s parameters are gathered, or their all-gather is under way (a
    prefetch: its output buffer already holds the whole unit)."""
    try:  # FSDP2's own state (torch 2.9 to 2.14)
        group = unit._get_fsdp_state()._fsdp_param_group
        return group is not None and (group.is_unsharded or
                                      group._all_gather_result is not None)
    except AttributeError:  # elsewhere: the unit's parameters are plain tensors while gathered
        from torch.distributed.tensor import DTensor  # see _local
        return not isinstance(next(unit.parameters()), DTensor)


def _tensors(output) -> list:
    """The tensors in a module's output: a tensor, or those in a tuple, list or dict."""
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for part in output for t in _tensors(part)]
    return []


class UnitsInFlight:
    """The most FSDP units gathered at once during a step (the memory model counts two under
    --sharding full: the one running and the one prefetched), sampled as each unit's forward
    starts and ends and as its backward starts.

    The backward sample is a hook on the unit's output tensors, as FSDP's own pre-backward
    is, and runs after FSDP's: the unit is gathered then and the next one prefetched, the most
    this unit's backward ever holds. A module's full backward hooks would wrap the output in a
    view instead, and a model that changes a unit's output in place (the CIFAR-10 CNN's
    ReLU(inplace=True) after each convolution) makes autograd refuse that view."""

    def __init__(self, units: list):
        self.units, self.most = units, 0
        for unit in units:
            unit.register_forward_pre_hook(lambda *_: self._sample())
            unit.register_forward_hook(self._after_forward)

    def _after_forward(self, _unit, _inputs, output) -> None:
        self._sample()
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(lambda _grad: self._sample())

    def _sample(self) -> None:
        self.most = max(self.most, sum(map(_gathered, self.units)))


def _keep_local(_state, bucket):
    """DDP's all-reduce on the fake process group gives back nothing; this hook hands DDP its
    own bucket, unreduced, as a finished result."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def report(train_step, wrapper: nn.Module, model: nn.Module, optimizer, loader, prepare,
           device: torch.device, world: int, offload: bool = False, units=None) -> int:
    """Train STEPS steps as rank 0 of ``world``, then print what this rank holds."""
    if isinstance(wrapper, DistributedDataParallel):
        wrapper.register_comm_hook(None, _keep_local)
    in_flight = UnitsInFlight(units) if units else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wrapper.train()
    trained = 0
    for images, labels in loading.to_device(loader, device):
        if trained == STEPS:
            break
        train_step(prepare(images, train=True), labels)
        trained += 1
    synchronize(device)
    mib = {k: v / memory.MIB for k, v in held(model, optimizer).items()}
    host = 0.0
    if offload:  # the shards, their gradients and the momentum live in host memory
        host, mib = sum(mib.values()), dict.fromkeys(mib, 0.0)
    figures = dict(world_size=world, params_mib=f"{mib['params']:.3f}",
                   grads_mib=f"{mib['grads']:.3f}", optimizer_mib=f"{mib['optimizer']:.3f}",
                   host_mib=f"{host:.3f}",
                   units_in_flight=in_flight.most if in_flight else "-",
                   peak_mib=f"{torch.cuda.max_memory_allocated(device) / memory.MIB:.1f}"
                   if device.type == "cuda" else "-")
    print0(contract.MEMORY_HELD_PREFIX + " " + " ".join(
        f"{k}={figures[k]}" for k in contract.MEMORY_HELD_KEYS))
    print0(f"{trained} step(s) trained as rank 0 of {world} on the fake process group: "
           f"memory figures only (no peer sent its part: no accuracy, nothing saved)")
    if trained < STEPS:  # the optimizer's state is made by the first step, resident from then
        print0(f"note: rank 0's share of the data made {trained} batch(es), not {STEPS}: the "
               f"peak may be short of a run's; give more samples (--synthetic-size) or a "
               f"smaller --batch-size")
    return 0
