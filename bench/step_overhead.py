"""What a strategy's step costs beyond the bare minimum, measured inside one process.

    python bench/step_overhead.py                                  # ResNet-18 on CPU
    python bench/step_overhead.py --model resnet50 --batch-size 256 # on a GPU node

Four variants of one training step on the same fixed batch, run in interleaved rounds (the
order rotating) so that the machine's drift hits each alike (separate processes differ by up
to 10% on a shared VM, which hides a few percent):
    bare         model, SGD, forward/backward/step
    ddp          the same inside DistributedDataParallel (world size 1), averaging per
                 gradient bucket as ddp_train.py does
    ddp+metrics  plus ddp_train.py's bookkeeping: device-side loss/accuracy sums, the
                 non-finite check, the GradScaler calls and the stop vote
    fsdp         fsdp_train.py's model and optimizer: FSDP2 units as the script makes them
                 (world size 1), SGD over the sharded (DTensor) parameters
Prints the median milliseconds per step, the cost relative to bare, and the Python function
calls of one step (cProfile's count, after the timing): the host's work, which decides the
step's time where the GPU waits for the host (small images, small batches).
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import fsdp_train  # noqa: E402
from training import flags, lossguard, measure, models, stopping, torch_private  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", help="model (default: resnet18)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size")
    p.add_argument("--rounds", type=int, default=12, help="interleaved rounds (first is warm-up)")
    p.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    args = p.parse_args(argv)
    if args.rounds < 2 or args.steps < 2 or args.batch_size < 1:
        p.error("--rounds and --steps must be 2 or more (each round's first step, and the first "
                "round, are warm-up) and --batch-size 1 or more")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    shape, classes = models.synthetic_shape(args.model)
    base = models.build_model(args.model, classes, shape).to(device)
    ids = [0] if device.type == "cuda" else None
    variants = {"bare": copy.deepcopy(base),
              "ddp": DDP(copy.deepcopy(base), device_ids=ids, gradient_as_bucket_view=True),
              "ddp+metrics": DDP(copy.deepcopy(base), device_ids=ids,
                                 gradient_as_bucket_view=True)}
    for name in ("ddp", "ddp+metrics"):  # as ddp_train.py sets up DDP at world size 1
        torch_private.ddp_average_per_bucket(variants[name])
    d = flags.add_common_args(argparse.ArgumentParser()).parse_args([])  # ddp_train's SGD
    opts = {k: torch.optim.SGD(m.parameters(), lr=d.lr, momentum=d.momentum,
                               weight_decay=d.weight_decay) for k, m in variants.items()}
    # fsdp_train.py's units (full sharding, fp32 as the others here) and its optimizer
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("shard",))
    fsdp_args = argparse.Namespace(sharding="full", offload=False, amp="off",
                                   momentum=d.momentum, weight_decay=d.weight_decay)
    variants["fsdp"] = fsdp_train.apply_fsdp(copy.deepcopy(base), mesh, fsdp_args, device)
    opts["fsdp"] = fsdp_train.build_optimizer(variants["fsdp"], d.lr, fsdp_args)
    x = torch.randn(args.batch_size, *shape, device=device)
    y = torch.randint(0, classes, (args.batch_size,), device=device)
    criterion = torch.nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # as in an fp32 run
    stop = stopping.StopRequest()
    sums = torch.zeros(3, device=device, dtype=torch.float64)  # as loop.Run keeps them
    watch = lossguard.LossWatch(device, scaler, classes, args.steps)
    times = {k: [] for k in variants}
    names = list(variants)

    def step(name, i):
        model, opt = variants[name], opts[name]
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = criterion(out, y)
        if name == "ddp+metrics":
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sums[0].add_(loss.detach(), alpha=y.size(0))
            sums[1].add_((out.argmax(1) == y).sum())
            sums[2].add_(y.size(0))
            watch.track(loss, i)
            stop.should_stop()
        else:
            loss.backward()
            opt.step()

    for rnd in range(args.rounds):
        k = rnd % len(names)  # rotate, so that no variant always runs last
        for name in names[k:] + names[:k]:
            for i in range(args.steps):
                measure.synchronize(device)
                t = time.perf_counter()
                step(name, i)
                measure.synchronize(device)
                if rnd > 0 and i > 0:  # round 0 and each round's first step are warm-up
                    times[name].append(time.perf_counter() - t)
    calls = {}
    for name in names:  # after the timing: the profiler slows what it watches
        profile = cProfile.Profile()
        profile.enable()
        step(name, 0)
        profile.disable()
        calls[name] = sum(stat.callcount for stat in profile.getstats())
    dist.destroy_process_group()
    bare = statistics.median(times["bare"])
    print(f"model {args.model}, batch {args.batch_size}, {device.type}, torch "
          f"{torch.__version__}, {args.rounds - 1} rounds x {args.steps - 1} steps measured")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"{name:12s} {med * 1000:8.1f} ms/step  {100 * (med / bare - 1):+6.1f}%  "
              f"{calls[name]:7,d} Python calls/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
