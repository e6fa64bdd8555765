"""Fully Sharded Data Parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``): one process per
GPU like DDP, but each rank keeps only a 1/N shard of the parameters, gradients and optimizer
state. Before a block runs, its parameters are all-gathered; after backward, its gradients are
reduce-scattered so each rank receives only the gradient of its own shard.

Run it (the shared flags and output lines of ddp_train.py; its own flag: --sharding):
    python fsdp_train.py                                  # 1 process; built-in synthetic data
    torchrun --nproc-per-node 2 fsdp_train.py             # 2 processes (CPU: gloo, GPU: NCCL)
    torchrun --nproc-per-node 4 fsdp_train.py --data-dir /data/tiny-imagenet-200 --sharding full
    STRATEGY=fsdp sbatch launch/multi_node.slurm --sharding hybrid

--sharding, and what each trades:
    full     FULL_SHARD. Parameters are freed again after each block's forward and all-gathered
             a second time in backward. Least memory (params, grads and optimizer state all
             1/N), most communication (2 all-gathers + 1 reduce-scatter per block and step).
    grad-op  SHARD_GRAD_OP. Parameters stay gathered from forward to backward: one all-gather
             less per block, but the whole unsharded model is resident during the step.
             Gradients and optimizer state are still sharded.
    hybrid   HSDP. A 2-D device mesh (nodes x GPUs per node): shard inside a node over the fast
             links, replicate across nodes, and all-reduce gradients between the replicas. Less
             traffic on the slower inter-node network; per-GPU memory like `full` on one node.

Units: one per repeated block (shard_units: ResNet's residual blocks with their BatchNorm
layers inside, ViT's encoder blocks, ...), plus the root for the stem and the classifier: per
block and step, one all-gather in forward (full and hybrid: another in backward) and one
reduce-scatter. (A unit per BatchNorm layer, 53 in ResNet-50, would add about 160 small,
latency-bound collectives per step.)

Mixed precision: the forward runs under autocast as in ddp_train.py, and gradients are
reduced in fp32. A model without BatchNorm also gathers its parameters in the --amp dtype
(``MixedPrecisionPolicy(param_dtype=...)``: half the all-gather traffic). A model with
BatchNorm (ResNet) gathers them in fp32: FSDP would cast BatchNorm's weights to the --amp dtype
too, while its running statistics stay fp32 buffers, and batch_norm rejects that mix (and
BatchNorm in fp16/bf16 loses precision, a known FSDP pitfall).
"""

from __future__ import annotations

import argparse
import shutil
from collections import Counter
from datetime import timedelta
from pathlib import Path

from training import ctrl_c  # first: a Ctrl-C while torch loads ends the script quietly

ctrl_c.quiet_while_loading(__name__)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch before 2.6: common.run() stops it with one sentence (the floor)
    CPUOffloadPolicy = MixedPrecisionPolicy = fully_shard = None
from torch.utils.data import DistributedSampler

from training import (bandwidth, checkpoint, common, datasets, distributed, flags, loading,
                      loop, memory, models, schedule, simulate, stopping)
from training.distributed import print0
from training.faults import UsageError, disk_full, end_process

STRATEGY = "fsdp"
# all-gather (parameters), reduce-scatter (gradients), all-reduce (between the replicas of
# --sharding hybrid)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
SHARDING = ("full", "grad-op", "hybrid")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Data-parallel training with FSDP2 (fully_shard): parameters, gradients "
                    "and optimizer state sharded across processes.",
        formatter_class=flags.HelpFormatter)
    flags.add_common_args(parser)
    flags.refuse_flags(parser, {
        "--cuda-graph": "--cuda-graph cannot capture FSDP's step: FSDP2 allocates and frees "
                        "each block's gathered parameters (storage resizes) in every forward "
                        "and backward, which a replayed graph cannot repeat; drop --cuda-graph, "
                        "or use ddp_train.py --cuda-graph"})
    g = parser.add_argument_group("FSDP")
    g.add_argument("--sharding", choices=SHARDING, default="full",
                   help="full: reshard parameters after forward (least memory); grad-op: keep "
                        "them gathered until backward (less communication); hybrid: shard "
                        "within a node, replicate across nodes (HSDP)")
    g.add_argument("--offload", action="store_true",
                   help="with --sharding full: keep the parameter shards, their gradients and "
                        "the optimizer state in host memory (CPUOffloadPolicy) and take the "
                        "optimizer step on the CPU; the GPU holds the blocks in flight and the "
                        "activations. Slower: every block crosses PCIe twice a step")
    return parser


def setup_distributed(args, env: distributed.DistEnv):
    """Pick the device and backend, join the process group, and build the device mesh."""
    if args.sharding == "hybrid" and env.source == "simulated":
        raise UsageError("--simulate-world-size simulates one node's ranks: use --sharding full "
                         "or grad-op (hybrid shards within a node the same way)")
    if args.sharding == "hybrid" and env.nodes * env.local_world_size != env.world_size:
        raise UsageError("--sharding hybrid needs the same number of processes on every node: "
                         "one torchrun --nproc-per-node, or srun --ntasks-per-node, for all")
    device, backend, shared = common.choose_device(args, env)  # this rank's GPU and NCCL
    if backend == "nccl" and args.offload:
        # --offload: the gradient shards live on the CPU, and fp16's GradScaler all-reduces
        # its inf check of them: a CPU backend beside NCCL carries that
        backend = "cpu:gloo,cuda:nccl"
    distributed.init_process_group(backend, env, args.dist_timeout)
    mesh = build_mesh(device.type, backend, env, args.sharding, args.dist_timeout)
    if shared:  # ranks that share a GPU (--share-gpus) talk over gloo
        print0(*distributed.shared_gpu_lines(torch.cuda.device_count(), env))
        # on the groups FSDP will use: the mesh's, and every rank's for the metrics
        uses = [("all_gather", mesh.get_group("shard")),
                ("reduce_scatter_avg", mesh.get_group("shard")),
                ("all_reduce", None), ("broadcast", None)]
        if args.sharding == "hybrid":
            uses.append(("all_reduce_avg", mesh.get_group("replicate")))
        distributed.check_gloo_on_cuda(device, uses)
    return device, backend, mesh


def build_mesh(device_type: str, backend: str, env: distributed.DistEnv, sharding: str,
               timeout_s: int) -> DeviceMesh:
    """The device mesh FSDP shards over, made of process groups on ``backend``, the one the
    ranks were given, never one torch picks: where CUDA is available, init_device_mesh gives
    a 1-D mesh over a gloo group a new group of its own, on "cpu:gloo,cuda:nccl" in torch 2.9
    and releases before it (on gloo in 2.14), and ranks sharing a GPU would then reach NCCL,
    which refuses them. --sharding hybrid: rows = nodes (replicas), columns = GPUs of one
    node (shards)."""
    if sharding != "hybrid":
        return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("shard",))
    layout = torch.arange(env.world_size).view(env.nodes, env.local_world_size)
    # Collective: every rank creates every group of a dimension, in the same order.
    timeout = timedelta(seconds=timeout_s)
    shard, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout,
                                                 backend=backend, group_desc="shard")
    replicate, _ = dist.new_subgroups_by_enumeration(layout.t().tolist(), timeout=timeout,
                                                     backend=backend, group_desc="replicate")
    return DeviceMesh.from_group([replicate, shard], device_type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def shard_units(model: nn.Module) -> list:
    """The blocks that become FSDP units (each gathers and reduce-scatters on its own): the
    modules that repeat. Walking down from the model, a module with weights whose class appears
    at least twice among its siblings (one parent's children, seen through Sequential and
    ModuleList containers) becomes a unit, whole; any other module is looked into. ResNet: its
    bottleneck blocks; torchvision's ViT: its encoder blocks; ConvNeXt and Swin: their blocks;
    the CIFAR-10 CNN and the MNIST net: each layer with weights. What no unit takes (a stem, a
    classifier) stays with the root."""
    units = []

    def siblings(parent):
        for child in parent.children():
            if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                yield from siblings(child)
            else:
                yield child

    def walk(parent):
        kids = list(siblings(parent))
        repeats = Counter(type(kid) for kid in kids)
        for kid in kids:
            if repeats[type(kid)] >= 2 and any(True for _ in kid.parameters()):
                units.append(kid)
            else:
                walk(kid)
    walk(model)
    return units


def gather_dtype(model: nn.Module, args) -> torch.dtype | None:
    """The dtype FSDP gathers the parameters in: the --amp dtype, but fp32 for a model with
    BatchNorm (autocast still computes in the --amp dtype); None: as stored (fp32)."""
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return None if has_bn else flags.amp_dtype(args)


def apply_fsdp(model: nn.Module, mesh, args, device: torch.device) -> nn.Module:
    reshard = args.sharding != "grad-op"  # grad-op keeps parameters gathered after forward
    mp = MixedPrecisionPolicy(param_dtype=gather_dtype(model, args), reduce_dtype=torch.float32)
    kw = dict(mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    if args.offload:  # shards, gradients and optimizer state in (pinned, on a GPU) host memory
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for unit in shard_units(model):  # bottom-up: the blocks first, then the root
        fully_shard(unit, **kw)
    fully_shard(model, **kw)  # the rest: the stem and the classifier
    return model


def average_batchnorm_statistics(model: nn.Module) -> None:
    """BatchNorm's running statistics are buffers, which FSDP neither shards nor keeps equal:
    each rank's follow its own batches (DDP instead copies rank 0's before every forward).
    Averaged over all ranks, in one all-reduce, before each evaluation and each checkpoint: every
    rank evaluates the same model, and the checkpoint and --save-model hold the statistics the
    evaluation used. The weights do not depend on them (training normalises with each batch's
    own statistics). Collective: every rank takes part."""
    world = dist.get_world_size()
    stats = [buf for m in model.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
             for buf in (m.running_mean, m.running_var)]
    if world == 1 or not stats:
        return
    flat = torch.cat([buf.reshape(-1) for buf in stats])
    dist.all_reduce(flat)  # a sum: gloo has no average
    flat /= world
    for buf, mean in zip(stats, flat.split([buf.numel() for buf in stats])):
        buf.copy_(mean.view_as(buf))


def save_checkpoint(path, state: dict, meta: dict) -> None:
    """FSDP: every rank writes its own shards with torch.distributed.checkpoint (DCP) into one
    folder, rank 0 adds the small rest (scheduler, scaler, every rank's RNG state, epoch and
    step, a checksum of each file DCP wrote), then renames the folder into place (it appears
    complete or not at all).
    Collective: every rank takes part. DCP can load it back at another world size."""
    # the same BatchNorm statistics on every rank: those DCP keeps of the replicated buffers
    # are then every rank's, and a resumed run goes on as the uninterrupted one does
    average_batchnorm_statistics(state["model"])
    tmp = path.with_name(f".tmp-{path.name}")
    rank, _ = distributed.rank_and_world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
    dist.barrier()
    model_sd, optim_sd = get_state_dict(state["model"], state["optimizer"])  # this rank's shards
    try:
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
        # A CRC-32 of every file DCP wrote, checked before they are loaded: DCP keeps no
        # checksum, and changed bytes in a shard would load as weights. The names come from
        # the .metadata DCP wrote (what dcp.save returns lacks them on torch 2.9), not from a
        # listing that a shared file system may not yet show.
        files = checkpoint.shard_files(tmp)
        sums = checkpoint.gather_checksums(tmp, [".metadata"] + files)  # collective
        if rank == 0:
            small = {name: state[name].state_dict() for name in ("scheduler", "scaler")}
            checkpoint.atomic_save(small | meta | {"checksums": sums}, tmp / "meta.pt")
            checkpoint.replace_checkpoint(tmp, path)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint
        # A full disk: for DCP's shards every rank sees it (DCP gathers the writers' errors),
        # for rank 0's meta.pt atomic_save's UsageError says so (its context, the OSError).
        if disk_full(exc):
            raise checkpoint.disk_full_error(path) from None
        raise
    # Checkpoints.save then waits, in its vote, until every rank (and rank 0's rename) is done.


def load_checkpoint(path, state: dict) -> dict:
    """Collective. Each rank reads the pieces of the saved shards it now owns, whatever world
    size wrote them (DCP reshards on load)."""
    meta = checkpoint.checked_meta(Path(path))  # collective: every rank, or Damaged on all
    model_sd, optim_sd = get_state_dict(state["model"], state["optimizer"])
    shards = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(shards, checkpoint_id=path)
    set_state_dict(state["model"], state["optimizer"], model_state_dict=shards["model"],
                   optim_state_dict=shards["optimizer"])
    for name in ("scheduler", "scaler"):
        # A run without fp16 saved its disabled GradScaler as an empty dict: keep the new one.
        if meta[name]:
            state[name].load_state_dict(meta[name])
    return meta


def save_model(model: nn.Module, path) -> None:
    """--save-model. Collective: every rank sends its shards; rank 0 receives the full
    tensors on the CPU and writes them."""
    if dist.get_backend() == "gloo":
        full = full_state_from_host_copies(model)
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    if distributed.rank_and_world()[0] == 0:
        checkpoint.save_model(full, path)
        print0(f"saved full (unsharded) model state_dict to {path}")


def full_state_from_host_copies(model: nn.Module) -> dict:
    """The full (unsharded) state dict on rank 0, {} on the others, gathered over gloo from
    host copies of the shards. With --share-gpus the shards are on a GPU, and gathering them
    as they are would take gloo's paths for CUDA tensors: the ones training uses work, but on
    torch 2.11 the three FSDP runs that ended with --save-model died in SIGSEGV on both ranks
    (gloo's coalesced all-gather copies CUDA memory as if it were the host's, PyTorch issue
    152645). A shard copied to the host first is gathered the way every CPU run gathers it.
    Collective: every rank gathers every tensor, in the same order."""
    rank = dist.get_rank()
    full, on_host = {}, {}  # the meshes, each once with the same groups on the host
    for name, value in get_model_state_dict(model).items():  # sharded, as FSDP holds them
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            if id(mesh) not in on_host:
                groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
                on_host[id(mesh)] = DeviceMesh.from_group(
                    groups if mesh.ndim > 1 else groups[0], "cpu",
                    mesh=mesh.mesh if mesh.ndim > 1 else None,
                    mesh_dim_names=mesh.mesh_dim_names)
            value = DTensor.from_local(value.to_local().cpu(), on_host[id(mesh)],
                                       value.placements, shape=value.shape,
                                       stride=value.stride(), run_check=False).full_tensor()
        if rank == 0:
            full[name] = value.detach().cpu() if torch.is_tensor(value) else value
    return full


def preflight(args, model: nn.Module, data, device: torch.device, world: int, mesh) -> bool:
    """Before training, with the whole model still on the CPU: rank 0's predicted memory per
    GPU (the [MEMORY] line, which collect_results.py sets beside the peak) and room in the
    checkpoint folder; --check: FSDP's collectives timed, then True (nothing to train);
    --profile: the bandwidth the step's collectives get."""
    if distributed.rank_and_world()[0] == 0:
        saved = memory.saved_for_backward(model, data.input_shape, args.amp)
        shards = mesh.shape[-1]  # the world size; hybrid: the GPUs of one node
        print0(memory_per_gpu(model, args, shards, saved, memory_variant(args)).line())
    checkpoint.check_checkpoint_dir(args.checkpoint_dir, model)
    grad_bytes = memory.param_bytes(model.parameters())  # fp32 gradients, as the parameters
    if args.check:
        bandwidth.collective_check(device, world, grad_bytes, COLLECTIVES)
        print0("preflight OK: data, batch size, devices"
               + (" and checkpoint dir" if args.checkpoint_dir else ""))
        return True
    if args.profile and world > 1:
        bandwidth.bus_bandwidth(device, world, [grad_bytes], COLLECTIVES,
                                collectives_per_step(model, args))
    return False


def build_optimizer(model: nn.Module, lr: float, args):
    """SGD with momentum over the sharded parameters: its momentum buffers are sharded too.
    (No fused=True here: DTensor has no fused SGD kernel; the foreach one is the default.)"""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)


def build_train_step(step_model, model, optimizer, scaler, args, device: torch.device):
    """The strategy's step, train_step(images, labels): forward under autocast (each unit
    gathers its parameters), loss, scaled backward (the gradients reduce-scattered), the
    optimizer step on this rank's shard. Returns (outputs, loss), still on the device."""
    criterion = nn.CrossEntropyLoss()
    dtype = flags.amp_dtype(args)

    def train_step(images, labels):
        optimizer.zero_grad(set_to_none=True)
        # forward: each unit gathers its parameters from its shard group; full/hybrid free
        # them after
        with torch.autocast(device.type, dtype=dtype or torch.float32,
                            enabled=dtype is not None):
            outputs = step_model(images)
            loss = criterion(outputs, labels)
        # backward gathers the parameters again (full and hybrid resharded them after
        # forward), then reduce-scatters the gradients: each rank keeps the averaged
        # gradient of its own shard (hybrid then all-reduces it across the nodes)
        scaler.scale(loss).backward()
        # --clip-grad-norm: each rank holds a shard of every gradient (a DTensor), so the
        # global norm adds up the shards' squares over the shard group: one all-reduce of one
        # number, inside clip_grad_norm_; fp16: unscaled first, so the true gradients are clipped
        if args.clip_grad_norm:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        scaler.step(optimizer)  # updates only this rank's shard
        scaler.update()
        return outputs, loss
    return train_step


def train(args, env: distributed.DistEnv) -> int:
    if args.estimate_memory is not None:  # a prediction only: no GPU, no process group
        return memory.estimate_only(args, memory_per_gpu, MEMORY_VARIANTS)
    device, backend, mesh = setup_distributed(args, env)
    flags.resolve_args(args, env, device)  # what needs the device: --amp, --num-workers
    rank, world = distributed.rank_and_world()  # the process group's, now that it is up
    common.print_start(args, env, device, backend)
    print0(f"sharding: {args.sharding} over mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}")

    data = datasets.build_data(args)
    checkpoint.check_writable(args.save_model)
    global_batch = args.batch_size * world
    datasets.describe(data, global_batch, f"{args.batch_size} per process x {world}")
    print0(f"global batch: {global_batch} = {args.batch_size} per process x {world} processes")

    # Same seed on every rank: identical full weights before sharding, so each rank keeps
    # its slice of the same model.
    torch.manual_seed(args.seed)
    model = models.build_model(args.model, data.num_classes, data.input_shape, args.batch_size)
    if preflight(args, model, data, device, world, mesh):  # --check: a preflight, no training
        return 0
    # From here on, randomness is per rank: crops, flips, dropout and the loader workers'
    # seeds differ between ranks (with one seed everywhere, rank r's i-th sample would get
    # the same crop as rank 0's i-th sample at every step).
    torch.manual_seed(distributed.seed_for_rank(args.seed, rank))
    # The batches go channels_last on CUDA, but not the weights: FSDP2 shards contiguous
    # parameters only (a channels_last conv weight raises NotImplementedError). cuDNN still
    # picks its channels_last kernels from the inputs.
    memory_format = models.memory_format(model, device)
    prepare = loading.batch_finisher(data, memory_format)  # augments, sets the format
    model = apply_fsdp(model.to(device), mesh, args, device)
    step_model = torch.compile(model, mode=args.compile) if args.compile else model

    batch = args.batch_size  # one DataLoader batch: this process's share of the global batch
    # Each rank reads a disjoint shard of the training set; the permutation depends on
    # (seed, epoch) only, so all ranks agree on it. drop_last keeps the shards equal.
    train_sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    train_batches = loading.SkipFirst(train_sampler)  # skips what a resumed epoch already saw
    val_sampler = DistributedSampler(data.val, num_replicas=world, rank=rank, shuffle=False)
    train_loader = loading.make_loader(data.train, train_batches, batch, args, device,
                                       drop_last=True)
    val_loader = loading.make_loader(data.val, val_sampler, batch, args, device,
                                     start_now=True, val=True)

    steps = min(len(train_loader), args.max_steps_per_epoch or len(train_loader))
    lr = schedule.peak_lr(args, global_batch)  # --lr, or --lr scaled with the global batch
    optimizer = build_optimizer(model, lr, args)  # SGD over the shards: its state sharded
    # per step: warm-up (--warmup-epochs), then x --gamma every --step-size epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor(args, steps))
    # Each rank checks only its gradient shard for inf/NaN; with FSDP2's DTensor gradients the
    # plain GradScaler all-reduces that verdict, so every rank skips (or takes) the same steps.
    # Without a fused optimizer, fp16 also costs a host sync per step (the scaler reads it).
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    train_step = build_train_step(step_model, model, optimizer, scaler, args, device)
    if args.simulate_world_size:  # rank 0 of N on the fake process group: its memory, no more
        return simulate.report(train_step, model, model, optimizer, train_loader, prepare,
                               device, world, args.offload, shard_units(model))

    state = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    stop = stopping.StopRequest(args.dist_timeout)  # SIGUSR1/SIGTERM, agreed by all ranks
    ckpt = checkpoint.Checkpoints(checkpoint.Settings.of(args), state, save_checkpoint,
                                  load_checkpoint)  # FSDP's: a DCP folder, from every rank
    start = ckpt.resume(steps)  # (epoch, step): (0, 0) for a fresh start
    info = loop.run_info(STRATEGY, args, data, device, world, env.nodes, env.local_world_size, lr)
    with loop.Run(loop.Settings.of(args), info, steps, start, stop, ckpt, step_model, optimizer,
                  scaler, device, [device], data) as run:
        for epoch in run.epochs():
            train_sampler.set_epoch(epoch)  # reshuffle: same permutation on all ranks
            data.set_epoch(epoch)  # and new crops and flips (TinyImageNet's folder path)
            train_batches.skip_samples = run.start_step * batch  # a resumed epoch's, in samples
            step_model.train()
            for step, (images, labels) in run.batches(train_loader):
                images = prepare(images, train=True)
                outputs, loss = train_step(images, labels)  # forward, backward, optimizer step
                run.step_done(step, loss, outputs, labels)  # the epoch's sums, on the device
                scheduler.step()
                run.save_or_stop(step)  # a checkpoint when due; a stop: the same step everywhere
            run.end_training()  # every rank's times, and the loss check
            average_batchnorm_statistics(model)  # every rank evaluates the same model
            val_sums = common.evaluate(step_model, val_loader, device, flags.amp_dtype(args),
                                       loading.real_samples(val_sampler), prepare)
            run.end_epoch(val_sums)  # reduced over all ranks: the epoch and [METRIC] lines
        run.finish()
        if args.save_model:
            save_model(model, args.save_model)
        run.final_report()
    return 0


def main(argv=None) -> int:
    return common.run(train, build_parser(), argv)


# --------------------------------------------------------------------------------------------
# What the strategy predicts about itself: the memory of one GPU (--estimate-memory and the
# [MEMORY] line, which collect_results.py sets beside the measured peak) and the collectives
# of one step (the scaling model's latency term)
# --------------------------------------------------------------------------------------------


def collectives_per_step(model: nn.Module, args) -> dict:
    """What one training step sends, for the scaling model's latency term (collect_results.py):
    per unit (the blocks and the root) an all-gather for forward and, after a reshard (full,
    hybrid), another for backward, and one reduce-scatter of its gradients."""
    units = len(shard_units(model)) + 1
    gathers = 1 if args.sharding == "grad-op" else 2
    return {"all_gather": gathers * units, "reduce_scatter": units}


# the rows --estimate-memory prints; memory_variant(args): the row of a run with these flags
MEMORY_VARIANTS = ("grad-op", "full", "offload")


def memory_variant(args) -> str:
    return "offload" if args.offload else args.sharding


def memory_per_gpu(model: nn.Module, args, world: int, saved: memory.Saved,
                   variant: str) -> memory.Estimate:
    """One GPU's memory under FSDP over ``world`` shards: 1/world of the parameters, gradients
    and momentum (rank 0's shards, padded like every rank's), whole buffers, and the unsharded
    blocks in flight: full (and hybrid, offload) the root, which stays gathered, and two
    neighbouring blocks, the one running and the one prefetched (the largest such pair);
    grad-op every block, gathered from forward to backward. In backward one block's unsharded
    fp32 gradient waits for its reduce-scatter. offload: the shards, gradients and momentum
    live in host memory instead. Gathered in the --amp dtype (a model without BatchNorm),
    the weights reach autocast in 16 bits: it makes no copies of them."""
    units = [list(unit.parameters()) for unit in shard_units(model)]
    in_units = {id(p) for unit in units for p in unit}
    root = [p for p in model.parameters() if id(p) not in in_units]
    numel = [sum(p.numel() for p in unit) for unit in units] or [0]
    pairs = [a + b for a, b in zip(numel, numel[1:])] or numel  # a block and the next one
    dtype = gather_dtype(model, args)
    gathered = (dtype or torch.float32).itemsize  # bytes per element
    if variant == "grad-op":
        in_flight = sum(p.numel() for p in model.parameters()) * gathered
    else:
        in_flight = (sum(p.numel() for p in root) + max(pairs)) * gathered
    comm = in_flight + max(numel) * 4  # and the fp32 gradient of one block
    shards = memory.fsdp_shard_bytes(model.parameters(), world)
    params, grads, optimizer = shards, shards, shards if args.momentum else 0
    buffers = memory.param_bytes(model.buffers())  # whole on every rank
    host = 0
    if variant == "offload":
        host, params, grads, optimizer = params + grads + optimizer, 0, 0, 0
    notes = ["hybrid: sharded over the GPUs of one node (world_size= here)"] \
        if variant == "hybrid" else []
    # each rank's loader holds its 1/world of the data and hands over its own batch (hybrid:
    # counted over the shards of one node, an upper bound across several)
    data, inputs = memory.data_and_inputs(args, world, args.batch_size, args.batch_size)
    return memory.Estimate(STRATEGY, variant, world, args.batch_size, saved, params, grads,
                           optimizer, buffers, comm, host=host, grads_at_peak=False,
                           notes=notes, data=data, inputs=inputs,
                           weights_cast=dtype is None)


if __name__ == "__main__":
    end_process(main())  # leaves without the interpreter's teardown: see end_process
