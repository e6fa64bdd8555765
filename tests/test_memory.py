"""The memory model (training/memory.py): the activations counted exactly and checked by a second,
independent count; the model states of every strategy equal to what 2 gloo ranks really hold;
--estimate-memory and --image-size as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from training import contract, memory, models
from conftest import (REPO, check_ok, env_for_tests, epoch_lines, metrics, run_script,
                      runs_two_at_a_time)


def graph_count(outputs: torch.Tensor, own: set) -> int:
    """A second count of what a forward saved, without hooks: walk the autograd graph from the
    outputs and read every node's saved tensors (its ``_saved_*`` attributes)."""
    seen, storages, todo = set(), {}, [outputs.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # a saved value that is not a tensor (e.g. undefined)
                continue
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in own:
                        storages[storage.data_ptr()] = storage.nbytes()
        todo += [parent for parent, _ in node.next_functions]
    return sum(storages.values())


@pytest.mark.parametrize("name,shape,amp", [("resnet18", (3, 64, 64), "off"),
                                            ("resnet18", (3, 64, 64), "bf16"),
                                            ("cnn", (3, 32, 32), "off"),
                                            ("mnist_net", (1, 28, 28), "off")])
def test_the_hook_count_equals_an_independent_graph_count(name, shape, amp):
    torch.manual_seed(0)
    model = models.build_model(name, 10, shape).train()
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    hooked, _ = memory.count_saved(model, shape, 4, amp)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp != "off"):
        outputs = model(torch.randn(4, *shape))
    assert hooked == graph_count(outputs, own) > 0


def test_a_hand_counted_model():
    """Linear(10, 20) -> ReLU -> Linear(20, 5) at batch 8, fp32: the first layer saves its input
    (8 x 10), ReLU its output (8 x 20), which the second layer saves again (counted once); the
    weights are parameters, left out."""
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    total, outputs = memory.count_saved(model, (10,), 8, "off")
    assert (total, outputs) == (8 * 10 * 4 + 8 * 20 * 4, 5)


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_two_counted_forwards_give_the_activations_at_any_batch_exactly(amp):
    """The estimate counts at batch 2 and 4 and extrapolates: at batch 16 it is the count."""
    torch.manual_seed(0)
    model = models.build_model("resnet18", 200, (3, 64, 64))
    saved = memory.saved_for_backward(model, (3, 64, 64), amp)
    counted, _ = memory.count_saved(model.train(), (3, 64, 64), 16, amp)
    estimate = memory.Estimate("ddp", "-", 1, 16, saved, 0, 0, 0, 0, 0)
    assert estimate.activations + estimate.amp_copies == pytest.approx(counted, abs=1)
    if amp == "bf16":  # the 16-bit copies of the weights: half the parameters' bytes
        params = memory.param_bytes(model.parameters())
        assert 0.45 * params < saved.fixed < 0.55 * params


def test_the_table_stays_aligned_at_any_size():
    """Every row's columns end where the header's do, from a small batch to one whose
    activations run to billions of MiB (a column is widened, never overrun)."""
    saved = memory.Saved(input_shape=(3, 224, 224), amp="bf16", per_image=42 * memory.MIB,
                         fixed=46 * memory.MIB, outputs_per_image=200)
    estimates = [memory.Estimate("ddp", "-", 8, 32, saved, 98e6, 98e6, 98e6, 0.2e6, 0),
                 memory.Estimate("fsdp", "grad-op", 1024, 10**8, saved, 1e6, 1e6, 1e6, 0, 0,
                                 grads_at_peak=False)]
    head, rule, *rows = memory.table(estimates)
    assert len(rule) == len(head) and all(len(row) == len(head) for row in rows)
    ends, at = [], head.index("GPUs") + 4  # where each column's title ends
    for _, title in memory.COLUMNS:
        at = head.index(title, at) + len(title)
        ends.append(at)
    for row in rows:  # each figure ends there, with a space before it
        figures = [m for m in re.finditer(r"\S+", row)][-len(ends):]
        assert [m.end() for m in figures] == ends
        assert all(row[m.start() - 1] == " " for m in figures)
    assert "4,200,000,000" in rows[1] and "1*" in rows[1]


def test_counting_leaves_the_model_and_the_random_state_as_they_were():
    torch.manual_seed(0)
    model = models.build_model("resnet18", 200, (3, 64, 64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    memory.saved_for_backward(model, (3, 64, 64), "off")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fsdp_shards_follow_torch_chunk():
    assert [memory.shard_rows(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert [memory.shard_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    assert [len(c) for c in torch.arange(10).chunk(4)] == [3, 3, 3, 1]


# One program per strategy, on 2 gloo ranks: what each rank really holds after two steps,
# against the model's prediction for this rank at world size 2.
STATES = r"""
import sys, torch, torch.distributed as dist, torch.nn as nn, argparse
sys.path.insert(0, {repo!r})
import ddp_train, fsdp_train
from training import memory, models
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
shape = (3, 64, 64)
model = models.build_model("resnet18", 201, shape)  # 201 classes: uneven shards
args = argparse.Namespace(amp="off", sharding="full", offload=False, zero1={zero1},
                          momentum=0.9, weight_decay=5e-4, batch_size=2,
                          gradient_as_bucket_view=True, dataset="synthetic", model="resnet18",
                          image_size=None, data_on_device=False)
saved = memory.saved_for_backward(model, shape, "off")
variant = "{variant}"
if variant == "full":
    predicted = fsdp_train.memory_per_gpu(model, args, world, saved, variant)
    mine = memory.fsdp_shard_bytes(model.parameters(), world, rank)
    expected = (mine, mine, mine)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp_train.apply_fsdp(model, mesh, args, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    local = lambda t: t.to_local()
else:
    predicted = ddp_train.memory_per_gpu(model, args, world, saved, variant)
    params = memory.param_bytes(model.parameters())
    part = memory.zero1_partition(list(model.parameters()), world)[rank]
    expected = (params, params, memory.param_bytes(part) if args.zero1 else params)
    model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = ddp_train.build_optimizer(model, 0.01, args, torch.device("cpu"))
    local = lambda t: t
for _ in range(2):
    optimizer.zero_grad(set_to_none=False)
    model(torch.randn(2, *shape)).logsumexp(1).mean().backward()
    optimizer.step()
inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own SGD: this rank's
nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)
held = (nbytes(model.parameters()), nbytes(p.grad for p in model.parameters()),
        nbytes(s["momentum_buffer"] for s in inner.state.values()))
# one string: unbuffered (PYTHONUNBUFFERED), print writes each argument on its own, and the
# two ranks' words interleave
print(f"rank {{rank}} held {{held}} expected {{expected}}", flush=True)
assert held == expected, (held, expected)
if rank == 0:  # the estimate of a run is rank 0's
    assert (predicted.params, predicted.grads, predicted.optimizer) == held, predicted
dist.destroy_process_group()
# without the interpreter's teardown, which can abort in a C++ destructor on this torch
# (faults.end_process says more): the scripts end the same way
from training.faults import end_process
end_process(0)
"""


@pytest.mark.parametrize("variant,zero1", [("-", False), ("zero1", True), ("full", False)])
def test_model_states_are_what_two_ranks_hold(tmp_path, variant, zero1):
    program = tmp_path / "states.py"
    program.write_text(STATES.format(repo=str(REPO), variant=variant, zero1=zero1))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(program)], capture_output=True, text=True,
                          timeout=300, env=env_for_tests(), cwd=tmp_path)
    check_ok(proc)
    held = re.findall(r"rank (\d) held \((\d+), (\d+), (\d+)\)", proc.stdout)
    assert sorted(r for r, *_ in held) == ["0", "1"]
    if variant != "-":  # sharded: the ranks hold different parts
        assert held[0][1:] != held[1][1:]


# A model without BatchNorm under FSDP and --amp bf16: FSDP gathers its weights in bf16, so
# autocast casts none. What the forward leaves saved for backward, each storage once (a
# resharded weight's storage is freed after forward, as FSDP2 frees it), against the
# activations and amp copies the estimate counts, on one gloo rank.
FSDP_SAVED = r"""
import argparse, sys, torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
import fsdp_train
from torch.distributed.device_mesh import init_device_mesh
from training import memory, models
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
shape, batch = (1, 28, 28), 4
model = models.build_model("mnist_net", 10, shape)
args = argparse.Namespace(amp="bf16", sharding="{variant}", offload=False, momentum=0.9,
                          batch_size=batch, dataset="synthetic", data_on_device=False,
                          model="mnist_net", image_size=None)
saved = memory.saved_for_backward(model, shape, "bf16")
predicted = fsdp_train.memory_per_gpu(model, args, 1, saved, "{variant}")
model = fsdp_train.apply_fsdp(model, init_device_mesh("cpu", (1,)), args, torch.device("cpu"))
own = {{t.to_local().untyped_storage().data_ptr() for t in model.parameters()}}  # the shards
storages = {{}}

def pack(tensor):
    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage()
    return tensor

with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
        torch.autocast("cpu", dtype=torch.bfloat16):
    out = model(torch.randn(batch, *shape))
held = sum(s.nbytes() for ptr, s in storages.items() if ptr not in own)
print(f"held {{held}} activations {{predicted.activations}} amp_copies {{predicted.amp_copies}}"
      f" comm {{predicted.comm}}", flush=True)
extra = held - predicted.activations - predicted.amp_copies
if "{variant}" == "full":  # the weights are resharded after forward: nothing else is held
    assert abs(extra) < 16 * 1024, (held, predicted)
else:  # grad-op: the weights stay gathered, in bf16, as comm counts them (not amp_copies)
    bf16_weights = 2 * sum(p.numel() for p in model.parameters())
    assert 0 < extra <= bf16_weights <= predicted.comm, (held, predicted)
out.float().sum().backward()
dist.destroy_process_group()
from training.faults import end_process
end_process(0)
"""


@pytest.mark.parametrize("variant", ["full", "grad-op"])
def test_fsdp_gathering_in_bf16_leaves_autocast_no_weights_to_copy(tmp_path, variant):
    program = tmp_path / "fsdp_saved.py"
    program.write_text(FSDP_SAVED.format(repo=str(REPO), variant=variant))
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True,
                          timeout=300, env=env_for_tests(), cwd=tmp_path)
    check_ok(proc)
    assert "amp_copies 0" in proc.stdout


def test_fsdp_full_gathers_two_neighbouring_blocks_and_never_more_than_grad_op():
    """The block running and the one prefetched are neighbours: the CNN's one large block (a
    Linear layer) is gathered once, not counted as both; and keeping blocks sharded after
    forward (full) never needs more than keeping them gathered (grad-op)."""
    import fsdp_train
    import argparse
    for name, shape in (("cnn", (3, 32, 32)), ("mnist_net", (1, 28, 28)),
                        ("resnet18", (3, 64, 64))):
        model = models.build_model(name, 10, shape)
        args = argparse.Namespace(amp="off", sharding="full", offload=False, momentum=0.9,
                                  batch_size=8, dataset="synthetic", data_on_device=False,
                                  model=name, image_size=None)
        saved = memory.saved_for_backward(model, shape, "off")
        full, grad_op = (fsdp_train.memory_per_gpu(model, args, 2, saved, v)
                         for v in ("full", "grad-op"))
        numel = [sum(p.numel() for p in unit.parameters())
                 for unit in fsdp_train.shard_units(model)]
        in_units = sum(numel)
        root = sum(p.numel() for p in model.parameters()) - in_units
        pair = max(a + b for a, b in zip(numel, numel[1:]))
        assert full.comm == (root + pair + max(numel)) * 4, name
        assert full.peak <= grad_op.peak, name


# Each rank's --data-on-device loaders against the DataLoader's, over two epochs and an epoch
# resumed after two steps: the same batches, and while training, the bytes they hold on the
# device (their ``held`` tensors) equal to the memory model's data_mib.
HELD = r"""
import itertools, sys, torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
import ddp_train
from torch.utils.data import DistributedSampler
from training import datasets, flags, loading, memory
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
args = ddp_train.build_parser().parse_args({argv!r})
flags.check_flags(args)  # the defaults that depend on the dataset
data = datasets.build_data(args)
batch, cpu = args.batch_size, torch.device("cpu")


def loaders(on_device):
    # as ddp_train.py makes them
    args.data_on_device = on_device
    sampler = loading.SkipFirst(DistributedSampler(
        data.train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True))
    val = DistributedSampler(data.val, num_replicas=world, rank=rank, shuffle=False)
    return (sampler, loading.make_loader(data.train, sampler, batch, args, cpu, drop_last=True),
            loading.make_loader(data.val, val, batch, args, cpu, val=True))


(host_sampler, host, host_val), (dev_sampler, dev, dev_val) = loaders(False), loaders(True)
predicted, _ = memory.data_and_inputs(args, world, batch, batch)
steps, held = 0, []
for epoch, skipped in ((0, 0), (1, 0), (1, 2)):  # (1, 2): epoch 1 resumed after two steps
    for sampler in (host_sampler, dev_sampler):
        sampler.set_epoch(epoch)
        sampler.skip_samples = skipped * batch
    # with a cap, the steps of the epoch: a resumed one's less those it ran
    cap = args.max_steps_per_epoch - skipped if args.max_steps_per_epoch else None
    for (x, y), (dx, dy) in zip(itertools.islice(host, cap), dev, strict=True):
        assert torch.equal(x, dx) and torch.equal(y, dy), (epoch, skipped)
        if not skipped:
            held.append(sum(t.untyped_storage().nbytes() for t in (*dev.held, *dev_val.held)))
        steps += 1
for (x, y, *_), (dx, dy) in zip(host_val, dev_val, strict=True):  # *_: survivors
    assert torch.equal(x, dx) and torch.equal(y, dy)
print(f"rank {{rank}} steps {{steps}} held {{set(held)}} predicted {{predicted}}", flush=True)
assert set(held) == {{predicted}}, (held, predicted)
dist.destroy_process_group()
from training.faults import end_process
end_process(0)
"""


@pytest.mark.parametrize("data,world,cap", [("synthetic", 1, None), ("synthetic", 2, None),
                                            ("cache", 2, None), ("cache", 2, 4)])
def test_data_on_device_holds_data_mib_and_gives_the_loaders_batches(tiny_imagenet, tmp_path,
                                                                     data, world, cap):
    """cap: --max-steps-per-epoch; the rank then holds only those batches of its shard (and
    the model counts them), the first cap of the DataLoader's, a resumed epoch's too."""
    if data == "synthetic":  # 100 over 2 ranks: 50 each, 6 batches of 8 and 2 dropped
        argv = ["--model", "cnn", "--synthetic-size", "100"]
    else:  # 160 over 2 ranks: 80 each, 10 batches
        argv = ["--data-dir", str(tiny_imagenet[0]), "--data-cache", str(tmp_path / "cache"),
                "--model", "resnet18"]
    program = tmp_path / "held.py"
    argv += ["--max-steps-per-epoch", str(cap)] if cap else []
    program.write_text(HELD.format(repo=str(REPO), argv=argv + ["--batch-size", "8",
                                                                "--num-workers", "0"]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world}", str(program)], capture_output=True,
                          text=True, timeout=300, env=env_for_tests(), cwd=tmp_path)
    check_ok(proc)
    found = re.findall(r"rank \d steps (\d+) held \{(\d+)\} predicted (\d+)", proc.stdout)
    assert len(found) == world
    per_rank = cap or (100 // world // 8 if data == "synthetic" else 10)
    for steps, held, predicted in found:
        assert int(steps) == 3 * per_rank - 2 and held == predicted
        if data == "synthetic":  # two splits' prototypes (10 classes, uint8), their noise
            # fields (int16), and a noise offset and a label for each sample
            assert int(held) == (2 * 10 * 3 * 32 * 32 + 2 * 2 * (3 * 32 * 32 + 65536)
                                 + per_rank * 8 * 16)
        else:  # the rank's samples of the epoch: uint8 64 x 64 x 3 and an int64 label each
            assert int(held) == per_rank * 8 * (64 * 64 * 3 + 8)


def _memory_lines(stdout: str) -> list:
    found = [contract.fields(line, contract.MEMORY_PREFIX) for line in stdout.splitlines()]
    return [f for f, stray in filter(None, found)]


def test_a_cuda_graphs_own_copy_of_the_batch_is_counted_in_its_inputs():
    """--cuda-graph's step reads its batch from a copy of its own (cudagraph.StepCapture: the
    float32 images and int64 labels), which the model left out: 147 MiB at 224 px, batch 256,
    on the GPU 11,622 against 11,473 MiB for the eager run."""
    import ddp_train
    from training import flags
    argv = ["--image-size", "224", "--batch-size", "256", "--amp", "bf16"]
    eager, graph = (ddp_train.build_parser().parse_args(argv + extra)
                    for extra in ([], ["--cuda-graph"]))
    for args in (eager, graph):
        flags.check_flags(args)
    (data, inputs), (graph_data, graph_inputs) = (memory.data_and_inputs(a, 1, 256, 256)
                                                  for a in (eager, graph))
    assert graph_data == data and graph_inputs - inputs == 256 * (3 * 224 * 224 * 4 + 8)
    assert round((graph_inputs - inputs) / 2**20) == 147


def test_estimate_memory_prints_every_rung_and_exits_without_a_process_group():
    proc = run_script("fsdp_train.py", ["--estimate-memory", "--batch-size", "32",
                                        "--image-size", "128"], timeout=300)
    check_ok(proc)
    lines = _memory_lines(proc.stdout)
    assert [(m["variant"], m["world_size"]) for m in lines] == [
        (v, str(n)) for v in ("grad-op", "full", "offload") for n in (1, 2, 4, 8)]
    for m in lines:
        assert tuple(m) == contract.MEMORY_KEYS
        assert (m["image_size"], m["per_gpu_batch"], m["amp"]) == ("128", "32", "bf16")
    full = {m["world_size"]: float(m["params_mib"]) for m in lines if m["variant"] == "full"}
    assert full["8"] < full["4"] < full["2"] < full["1"]  # 1/N of the parameters
    offload = [m for m in lines if m["variant"] == "offload"]
    assert all(float(m["params_mib"]) == 0 < float(m["host_mib"]) for m in offload)
    assert "Predicted memory per GPU (MiB): resnet50 at 128x128, batch 32 per GPU" in proc.stdout
    assert "not counted: allocator fragmentation" in proc.stdout
    assert "Epoch [" not in proc.stdout and "process group" not in proc.stderr


def test_estimate_memory_for_ddp_zero1_shards_the_optimizer_state():
    proc = run_script("ddp_train.py", ["--estimate-memory", "4", "--amp", "off"], timeout=300)
    check_ok(proc)
    ddp, zero1 = _memory_lines(proc.stdout)
    assert (ddp["variant"], zero1["variant"], zero1["world_size"]) == ("-", "zero1", "4")
    assert ddp["params_mib"] == zero1["params_mib"] and ddp["grads_mib"] == zero1["grads_mib"]
    assert float(zero1["optimizer_mib"]) < float(ddp["optimizer_mib"]) / 3
    assert float(ddp["amp_copies_mib"]) < 1  # fp32: no weights cast
    # DDP's peak: every part, the measured workspace among them (no backward transient now)
    parts = ("params", "grads", "optimizer", "buffers", "amp_copies", "activations", "comm",
             "workspace", "data", "inputs")
    for m in (ddp, zero1):
        assert float(m["workspace_mib"]) == memory.WORKSPACE / memory.MIB == 86
        assert float(m["peak_mib"]) == pytest.approx(sum(float(m[f"{k}_mib"]) for k in parts),
                                                     abs=0.5)


def test_dp_estimate_memory_says_its_gpus_flag_does_nothing():
    """--estimate-memory N predicts for N GPUs: dp_train.py's --gpus beside it changes nothing,
    and is said so rather than taken in silence."""
    proc = run_script("dp_train.py", ["--estimate-memory", "4", "--gpus", "2", "--model", "cnn"],
                      timeout=120)
    check_ok(proc)
    assert ("note: --gpus 2 does nothing with --estimate-memory, which predicts for 4 GPU(s): "
            "for 2, use --estimate-memory 2 and drop --gpus") in proc.stdout
    assert [m["world_size"] for m in _memory_lines(proc.stdout)] == ["4"]


@pytest.fixture(scope="module")
def bad_flag_runs(request):
    return runs_two_at_a_time(request, "test_bad_memory_flags_exit_2",
                              lambda case: run_script("ddp_train.py", case["args"], timeout=120))


@pytest.mark.parametrize("args,message", [
    (["--estimate-memory", "0"], "--estimate-memory N: N is a number of GPUs, at least 1"),
    # -1 was the internal "no N" and printed the whole table
    (["--estimate-memory", "-1"], "--estimate-memory N: N is a number of GPUs, at least 1"),
    (["--image-size", "224", "--dataset", "cifar10"],
     "--image-size works with TinyImageNet and synthetic data only"),
    (["--image-size", "224", "--model", "cnn"], "--model cnn takes its dataset's fixed image"),
    (["--image-size", "8"], "--image-size is the side of the square image in pixels, 16 to"),
])
def test_bad_memory_flags_exit_2(args, message, bad_flag_runs, request):
    proc = bad_flag_runs[request.node.callspec.id].result()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("cache", [False, True])
def test_image_size_224_trains_and_says_so(tiny_imagenet, tmp_path, cache):
    """The folder path resizes in the loader, the cache path on the device: both train at
    224 x 224, and the [MEMORY], epoch and [METRIC] lines say so."""
    root, _ = tiny_imagenet
    extra = ["--data-cache", str(tmp_path / "cache")] if cache else []
    proc = run_script("ddp_train.py", ["--data-dir", str(root), "--model", "resnet18",
                                       "--image-size", "224", "--batch-size", "4", "--epochs",
                                       "1", "--max-steps-per-epoch", "2", "--num-workers", "0",
                                       "--amp", "off", *extra], timeout=600)
    check_ok(proc)
    assert "resized from 64x64 to 224x224" in proc.stdout
    m = metrics(proc.stdout)[-1]
    assert m["image_size"] == "224" and float(m["train_loss"]) > 0
    assert epoch_lines(proc.stdout)[-1][-1] == "224"
    (predicted,) = _memory_lines(proc.stdout)
    assert (predicted["image_size"], predicted["per_gpu_batch"]) == ("224", "4")
    # 224 x 224 is 12.25 times the pixels of 64 x 64: about as many times the activations
    small = memory.saved_for_backward(models.build_model("resnet18", 4, (3, 64, 64)),
                                      (3, 64, 64), "off")
    assert 11 < float(predicted["activations_mib"]) * 2**20 / (4 * small.per_image) < 13
