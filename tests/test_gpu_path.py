"""The CUDA/NCCL path's defects, each shown on CPU: per-rank augmentation, one NaN verdict for
all ranks, the GPU a process drives, DataParallel's --compile and cudnn settings, per-epoch
memory peaks, bf16 on old GPUs, FSDP2 units, and the data held on the device."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import FAST, REPO, check_ok, env_for_tests, fake_gpus, metrics, run_script

from training import distributed

from training import cudagraph, devices, faults, flags, measure, stopping

PATCHED = REPO / "tests" / "patched_run.py"


def run_patched(patch: str, out, script: str, args, nproc: int = 2, timeout: int = 300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(PATCHED), patch, str(out), script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env_for_tests(), cwd=REPO)


# ---- 1. every rank draws its own crops and flips, reproducibly from --seed
def test_ranks_draw_different_augmentations_reproducibly(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    args = ["--data-dir", str(root), "--data-cache", str(tmp_path / "cache"), "--model",
            "resnet18", "--batch-size", "8", "--epochs", "1", "--max-steps-per-epoch", "1",
            "--num-workers", "0"]
    draws = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        out = tmp_path / name
        out.mkdir()
        check_ok(run_patched("record_augment", out, "ddp_train.py", args + ["--seed", seed]))
        draws[name] = [torch.load(out / f"augment-rank{r}.pt") for r in (0, 1)]
    a0, a1 = draws["a"]
    assert not torch.equal(a0, a1), "rank 0 and rank 1 drew the same crops and flips"
    assert torch.equal(a0, draws["b"][0]) and torch.equal(a1, draws["b"][1]), \
        "the same --seed must give the same augmentation"
    assert not torch.equal(a0, draws["c"][0]), "another --seed must give another augmentation"


def test_ranks_loader_workers_have_different_seeds(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    check_ok(run_patched("record_worker_seed", tmp_path, "ddp_train.py",
                         ["--data-dir", str(root), "--model", "resnet18", "--batch-size", "8",
                          "--epochs", "1", "--max-steps-per-epoch", "2", "--num-workers", "1"]))
    seeds = {r: {p.read_text() for p in tmp_path.glob(f"worker-rank{r}-*.txt")} for r in (0, 1)}
    assert seeds[0] and seeds[1]
    assert not seeds[0] & seeds[1], f"workers of both ranks share a seed: {seeds}"


def test_seed_for_rank_is_distinct_and_stable():
    seeds = [distributed.seed_for_rank(0, r) for r in range(64)]
    assert len(set(seeds)) == 64
    assert seeds == [distributed.seed_for_rank(0, r) for r in range(64)]
    assert distributed.seed_for_rank(1, 0) != seeds[0]


# ---- 2. a NaN on one rank stops every rank at once, with one message
@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py"])
def test_nan_on_one_rank_stops_the_whole_job_quickly(script, tmp_path):
    t0 = time.monotonic()
    proc = run_patched("nan_on_rank1", tmp_path, script, FAST + ["--dist-timeout", "300"])
    seconds = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert seconds < 90, f"took {seconds:.0f} s: a rank waited for --dist-timeout"
    assert out.count("the loss became NaN or inf at epoch 1, step 3;") == 1, out[-3000:]
    # no rank was left waiting in a collective, and none crashed with a traceback of its own
    assert "failed or timed out" not in out and "NonFiniteLoss" not in out, out[-3000:]


def test_a_nan_validation_loss_is_named_and_the_run_goes_on(tmp_path):
    """The NaN guard watches the training loss; a validation loss that became NaN (on rank 1's
    share of the images) was a "nan" in the epoch's line alone."""
    proc = run_patched("nan_in_rank1s_second_evaluation", tmp_path, "ddp_train.py", FAST)
    check_ok(proc)
    out = proc.stdout + proc.stderr
    epochs = metrics(proc.stdout)
    assert epochs[0]["val_loss"] != "nan" and epochs[1]["val_loss"] == "nan", out[-3000:]
    warnings = [line for line in out.splitlines() if "the validation loss is" in line]
    assert len(warnings) == 1, out[-3000:]
    assert re.fullmatch(r"warning: the validation loss is nan at epoch 2, its training loss "
                        r"[0-9.]+: the model's outputs on some validation images are not "
                        r"finite: check those images and the model's BatchNorm running "
                        r"statistics", warnings[0]), warnings[0]


# ---- 3. which GPU a process drives
@pytest.mark.parametrize("visible, local_rank, local_world, source, expected", [
    (1, 0, 4, "slurm", 0),   # srun --gpus-per-task=1: each task sees its own GPU as cuda:0
    (1, 3, 4, "slurm", 0),
    (1, 0, 1, "torchrun", 0),
    (4, 2, 4, "torchrun", 2),
    (8, 3, 4, "slurm", 3),
    (4, 1, 4, "slurm", 1),   # srun --gpus-per-node=4: every task sees all four
])
def test_gpu_index(visible, local_rank, local_world, source, expected):
    assert distributed.gpu_index(visible, local_rank, local_world, source) == expected


@pytest.mark.parametrize("visible, local_world, source, fix", [
    (2, 4, "torchrun", "--nproc-per-node 2"),
    (1, 2, "torchrun", "--nproc-per-node 1"),   # two processes on one GPU: NCCL would fail
    (2, 4, "slurm", "--gpus-per-task=1"),
])
def test_gpu_index_too_few_gpus_names_the_fix(visible, local_world, source, fix):
    with pytest.raises(faults.UsageError, match="processes were started on this node") as e:
        distributed.gpu_index(visible, 0, local_world, source)
    assert fix in str(e.value)


@pytest.mark.parametrize("tasks, node, expected", [("3,2", "1", 2), ("3,2", "0", 3),
                                                   ("2(x3),1", "2", 2), ("2(x3),1", "3", 1)])
def test_srun_uneven_tasks_per_node(monkeypatch, tasks, node, expected):
    for k, v in {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
                 "SLURM_STEP_NUM_TASKS": "5" if tasks == "3,2" else "7",
                 "SLURM_STEP_NUM_NODES": "2" if tasks == "3,2" else "4",
                 "SLURM_STEP_TASKS_PER_NODE": tasks, "SLURM_NODEID": node,
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    env = distributed.dist_env()
    assert (env.local_world_size, env.nodes) == (expected, 2 if tasks == "3,2" else 4)


def test_srun_ntasks_per_node_without_step_list(monkeypatch):
    for k, v in {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                 "SLURM_NTASKS": "6", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "3",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
              "SLURM_STEP_NUM_NODES"):
        monkeypatch.delenv(k, raising=False)
    env = distributed.dist_env()
    assert (env.world_size, env.local_world_size, env.nodes) == (6, 3, 2)


# ---- 4, 5. DataParallel: --compile over several GPUs is refused; cudnn.benchmark is on
def test_dp_compile_with_several_gpus_is_refused(monkeypatch, capsys):
    import dp_train
    fake_gpus(monkeypatch, 2)
    assert dp_train.main(FAST + ["--compile"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compile cannot be combined with DataParallel" in err
    assert "ddp_train.py --compile" in err


def test_dp_turns_on_cudnn_benchmark(monkeypatch):
    import dp_train
    fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    args = dp_train.build_parser().parse_args(FAST + ["--compile"])  # one GPU: compile is fine
    device, gpus = dp_train.setup_devices(args, distributed.DistEnv(0, 0, 1, 1, "single"))
    assert (device.type, gpus) == ("cuda", [0])
    assert torch.backends.cudnn.benchmark is True


# ---- 6. each epoch reports its own peak
def test_peak_memory_is_reset_per_epoch():
    cpu = torch.device("cpu")
    measure.reset_peak_memory(cpu)
    before = measure.peak_memory_mib(cpu)
    big = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched
    del big
    peak = measure.peak_memory_mib(cpu)
    assert peak > before + 250
    measure.reset_peak_memory(cpu)
    assert measure.peak_memory_mib(cpu) < peak - 250


def test_a_compiled_step_that_replays_cuda_graphs_keeps_the_recorded_peak(monkeypatch):
    """--compile reduce-overhead / max-autotune: a replay allocates nothing, so max_memory_allocated
    after the epoch that recorded the graphs sees only what lives outside them (966 against
    about 11,000 MiB on an H200); the later epochs keep the recorded epoch's peak as a floor."""
    allocated = {"peak": 0.0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d=None: allocated.update(peak=966 * 2**20))
    monkeypatch.setattr(cudagraph, "captured_peak_mib", {})
    gpu = torch.device("cuda", 0)
    for replays, later in ((False, 966.0), (True, 11000.0)):
        cudagraph.captured_peak_mib.clear()
        allocated["peak"] = 300 * 2**20  # the model and its states, before the first epoch
        measure.reset_peak_memory(gpu, replays=replays)  # epoch 1: records the graphs
        allocated["peak"] = 11000 * 2**20
        assert measure.peak_memory_mib(gpu) == 11000.0
        measure.reset_peak_memory(gpu, replays=replays)  # epoch 2: replays only
        assert measure.peak_memory_mib(gpu) == later
        allocated["peak"] = 12000 * 2**20  # an epoch that needs more still shows it
        assert measure.peak_memory_mib(gpu) == 12000.0


# ---- 8. bf16 needs compute capability 8.0; the default follows the GPU
@pytest.mark.parametrize("cc, flag, expected", [((9, 0), None, "bf16"), ((8, 0), None, "bf16"),
                                                ((7, 0), None, "fp16"), ((7, 0), "fp16", "fp16"),
                                                ((7, 0), "off", "off")])
def test_amp_default_follows_the_gpu(monkeypatch, cc, flag, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
    args = argparse.Namespace(**vars(flags.add_common_args(argparse.ArgumentParser())
                                     .parse_args([] if flag is None else ["--amp", flag])))
    flags.resolve_args(args, distributed.DistEnv(0, 0, 1, 1, "single"), torch.device("cuda", 0))
    assert args.amp == expected


def test_bf16_on_a_v100_names_fp16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla V100-SXM2-32GB")
    args = flags.add_common_args(argparse.ArgumentParser()).parse_args(["--amp", "bf16"])
    with pytest.raises(faults.UsageError, match="use --amp fp16") as e:
        flags.resolve_args(args, distributed.DistEnv(0, 0, 1, 1, "single"), torch.device("cuda", 0))
    assert "V100" in str(e.value) and "7.0" in str(e.value)


# ---- FSDP2: one unit per residual block plus the root; weights in the default memory format
# (FSDP2 shards contiguous parameters only), channels_last inputs as on CUDA
FSDP_UNITS = """
import torch, torch.distributed as dist, argparse
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
import fsdp_train
from training import models
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = models.build_model("resnet50", 200, (3, 64, 64))
args = argparse.Namespace(amp="bf16", sharding="full", offload=False)
model = fsdp_train.apply_fsdp(model, init_device_mesh("cpu", (1,)), args, torch.device("cpu"))
units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
print("units", len(units), "bn_units", sum("bn" in n for n in units))
x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
with torch.autocast("cpu", dtype=torch.bfloat16):
    model(x).float().sum().backward()
print("ok")
dist.destroy_process_group()
# without the interpreter's teardown, which can abort in a C++ destructor on this torch
# (faults.end_process says more): the scripts end the same way
from training.faults import end_process
end_process(0)
"""


def test_fsdp_shards_per_block_and_takes_channels_last_inputs():
    proc = subprocess.run([sys.executable, "-c", FSDP_UNITS], capture_output=True, text=True,
                          env=env_for_tests(), cwd=REPO, timeout=300)
    check_ok(proc)
    assert "units 17 bn_units 0" in proc.stdout  # 16 bottlenecks of ResNet-50 + the root
    assert "ok" in proc.stdout


# ---- the data held on the device gives the very same run as the DataLoader
def test_data_on_device_matches_the_loader():
    base = FAST + ["--model", "resnet18", "--max-steps-per-epoch", "3"]
    runs = []
    for extra in ([], ["--data-on-device"]):
        proc = run_script("ddp_train.py", base + extra, nproc=2)
        check_ok(proc)
        runs.append(metrics(proc.stdout)[-1])
    for key in ("train_loss", "train_acc", "val_loss", "val_acc", "train_images", "val_images"):
        assert runs[0][key] == runs[1][key], key


def test_data_on_device_with_the_cache(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    proc = run_script("fsdp_train.py", ["--data-dir", str(root), "--data-cache",
                                        str(tmp_path / "cache"), "--data-on-device", "--model",
                                        "resnet18", "--batch-size", "8", "--epochs", "1",
                                        "--num-workers", "0"], nproc=2)
    check_ok(proc)
    last = metrics(proc.stdout)[-1]
    assert int(last["train_images"]) == 160 // 16 * 16 and int(last["val_images"]) == 40


def test_data_on_device_needs_decoded_data(tiny_imagenet):
    root, _ = tiny_imagenet
    proc = run_script("ddp_train.py", ["--data-dir", str(root), "--data-on-device"])
    assert proc.returncode == 2
    assert "--data-on-device needs decoded data: add --data-cache" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag", ["--broadcast-buffers", "--no-broadcast-buffers"])
def test_ddp_buffer_broadcast_flag_runs_without_deprecation_warnings(flag):
    proc = run_script("ddp_train.py", FAST + ["--model", "resnet18", "--epochs", "1", flag],
                      nproc=2)
    check_ok(proc)
    assert f"broadcast_buffers={flag == '--broadcast-buffers'}" in proc.stdout
    assert "deprecated" not in proc.stderr, proc.stderr[-2000:]


# ---- --save-model writes CPU tensors, whatever device trained the model
def test_save_model_writes_cpu_tensors_of_a_model_on_the_gpu(monkeypatch, tmp_path):
    """A model on the GPU has CUDA tensors in its state_dict; saved as they were (ddp_train.py
    and dp_train.py did), torch.load(path, weights_only=True) fails on a machine without a GPU
    and the FSDP-against-DDP comparison fails on devices. FakeTensorMode makes CUDA tensors
    without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from training import checkpoint
    saved = {}
    monkeypatch.setattr(checkpoint, "atomic_save", lambda obj, path: saved.update(obj))
    with FakeTensorMode():
        weights = {"conv.weight": torch.empty(8, 3, 3, 3, device="cuda"),
                   "bn.num_batches_tracked": torch.tensor(5, device="cuda")}
        assert {w.device.type for w in weights.values()} == {"cuda"}
        checkpoint.save_model(weights, tmp_path / "model.pt")
    assert {k: v.device.type for k, v in saved.items()} == {"conv.weight": "cpu",
                                                           "bn.num_batches_tracked": "cpu"}


@pytest.mark.parametrize("script", ["ddp_train.py", "dp_train.py", "fsdp_train.py"])
def test_every_strategy_saves_its_model_through_save_model(script):
    text = (REPO / script).read_text()
    saving = text[text.index("def save_model("):text.index("\n\n\n", text.index("def save_model("))]
    assert "checkpoint.save_model(" in saving and "atomic_save" not in saving, saving
    assert "save_model(model, args.save_model)" in text  # train() calls it


# ---- fused SGD on CUDA, with fp16 too: tests/test_cuda_graph.py (its momentum made first)
@pytest.mark.parametrize("script", ["ddp_train.py", "dp_train.py"])
def test_the_scripts_choose_fused_sgd_on_cuda_and_make_the_momentum_first(script):
    text = (REPO / script).read_text()
    assert "fused=schedule.fused_sgd(device))" in text and "schedule.start_momentum(" in text


# ---- every collective of a run gives up after --dist-timeout: NCCL's watchdog (the process
# group's timeout) and the gloo group of the stop vote alike
def test_every_process_group_waits_for_dist_timeout_at_most(monkeypatch):
    from datetime import timedelta
    import torch.distributed as dist
    groups = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: groups.append(kw))
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: groups.append(kw))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(stopping.StopSignals, "training", stopping.StopSignals.training)
    monkeypatch.setenv("MASTER_PORT", "29999")
    distributed.init_process_group("nccl", distributed.DistEnv(0, 0, 2, 2, "torchrun"), 45)
    stopping.StopRequest(45)  # the stop vote's gloo group
    assert [g["timeout"] for g in groups] == [timedelta(seconds=45)] * 2
    assert groups[1]["backend"] == "gloo"


# ---- fsdp --offload on GPUs: the gradient shards live on the CPU, and fp16's GradScaler
# all-reduces its inf check of them, so the process group carries a CPU backend beside NCCL
@pytest.mark.parametrize("extra, backend", [
    (["--offload"], "cpu:gloo,cuda:nccl"), (["--sharding", "full"], "nccl"),
    (["--offload", "--share-gpus"], "gloo")])
def test_fsdp_offload_gets_a_cpu_backend_beside_nccl(monkeypatch, extra, backend):
    import fsdp_train
    fake_gpus(monkeypatch, 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed, "init_process_group", lambda b, env, t: chosen.append(b))
    monkeypatch.setattr(distributed, "check_gloo_on_cuda", lambda device, ops: None)
    mesh = SimpleNamespace(get_group=lambda dim: None)  # its groups go to the probe only
    monkeypatch.setattr(fsdp_train, "build_mesh", lambda *a, **k: mesh)
    monkeypatch.setattr(devices, "use_gpu", lambda args: True)  # common.choose_device asks it
    args = fsdp_train.build_parser().parse_args(extra)
    world = 2 if "--share-gpus" in extra else 1
    fsdp_train.setup_distributed(args, distributed.DistEnv(0, 0, world, world, "torchrun"))
    assert chosen == [backend]


# ---- fsdp, ranks sharing a GPU: the mesh is made on gloo, and the start-up probe checks the
# collectives on the groups FSDP will run them on (tests/test_simulate.py runs both for real)
@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_fsdp_ranks_sharing_a_gpu_probe_the_meshs_groups(monkeypatch, sharding):
    import fsdp_train
    fake_gpus(monkeypatch, 1)
    made, probed = [], []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed, "init_process_group", lambda b, env, t: None)
    monkeypatch.setattr(distributed, "check_gloo_on_cuda", lambda device, uses: probed.extend(uses))
    mesh = SimpleNamespace(get_group=lambda dim: f"the mesh's {dim} group")

    def build_mesh(device_type, backend, env, sharding, timeout_s):
        made.append((device_type, backend, sharding))
        return mesh
    monkeypatch.setattr(fsdp_train, "build_mesh", build_mesh)
    monkeypatch.setattr(devices, "use_gpu", lambda args: True)  # common.choose_device asks it
    args = fsdp_train.build_parser().parse_args(["--share-gpus", "--sharding", sharding])
    fsdp_train.setup_distributed(args, distributed.DistEnv(0, 0, 2, 2, "torchrun"))
    assert made == [("cuda", "gloo", sharding)]
    shard = "the mesh's shard group"
    expected = [("all_gather", shard), ("reduce_scatter_avg", shard), ("all_reduce", None),
                ("broadcast", None)]  # None: every rank's group (the metrics, the start)
    if sharding == "hybrid":
        expected.append(("all_reduce_avg", "the mesh's replicate group"))
    assert probed == expected


def test_a_cache_build_longer_than_dist_timeout_is_waited_for(tiny_imagenet, tmp_path):
    """Under plain torchrun, local rank 0 builds the decoded cache inside the process group
    while the other ranks wait. Before: they waited in a collective bounded by --dist-timeout,
    and a build longer than that killed them ("another rank probably died"). Now they wait on a
    group of their own, as long as a build takes."""
    root, _ = tiny_imagenet
    proc = run_patched("slow_cache_build", tmp_path, "ddp_train.py",
                       ["--data-dir", str(root), "--data-cache", str(tmp_path / "cache"),
                        "--model", "resnet18", "--batch-size", "8", "--epochs", "1",
                        "--max-steps-per-epoch", "1", "--num-workers", "0",
                        "--dist-timeout", "3"])
    check_ok(proc)
    assert "Epoch [1/1]" in proc.stdout
