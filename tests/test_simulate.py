"""--simulate-world-size N (training/simulate.py): one process as rank 0 of N on torch's fake
process group holds what one GPU of N holds, which is what the memory model predicts; and FSDP
shards the blocks that repeat, for any model."""

from __future__ import annotations

import importlib
import re
from collections import Counter

import pytest
import torchvision

from conftest import REPO, check_ok, run_script, runs_two_at_a_time
from training import contract, distributed, faults, memory, models

RUNGS = [("ddp_train.py", [], "-"), ("ddp_train.py", ["--zero1"], "zero1"),
         ("fsdp_train.py", ["--sharding", "grad-op"], "grad-op"),
         ("fsdp_train.py", ["--sharding", "full"], "full"),
         ("fsdp_train.py", ["--offload"], "offload")]


def _held(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if contract.MEMORY_HELD_PREFIX in line]
    assert len(lines) == 1, stdout
    fields, stray = contract.fields(lines[0], contract.MEMORY_HELD_PREFIX)
    assert not stray and tuple(fields) == contract.MEMORY_HELD_KEYS, lines[0]
    return fields


def _predicted(script: str, extra: list, variant: str, world: int, model_name: str,
               classes: int, shape: tuple = (3, 64, 64)) -> memory.Estimate:
    """The memory model's figures for rank 0 of ``world``, in bytes, as the script computes them
    (the model built the same way: its shapes are all that count)."""
    module = importlib.import_module(script[:-3])
    args = module.build_parser().parse_args(extra + ["--model", model_name])
    model = models.build_model(model_name, classes, shape)
    saved = memory.Saved(0, 0, shape, "off", classes)
    return module.memory_per_gpu(model, args, world, saved, variant)


def _simulate_rung(case: dict):
    world = case["world"]
    return run_script(case["script"], ["--model", "resnet50", "--batch-size", "2",
                                       "--synthetic-size", str(4 * world), "--num-workers", "0",
                                       "--amp", "off", "--simulate-world-size", str(world),
                                       *case["extra"]], timeout=300)


@pytest.fixture(scope="module")
def rung_runs(request):
    return runs_two_at_a_time(request, "test_rank0_of_n_holds_what_the_memory_model_predicts",
                              _simulate_rung)


@pytest.mark.parametrize("world", [2, 8, 64])
@pytest.mark.parametrize("script, extra, variant", RUNGS, ids=[v for _, _, v in RUNGS])
def test_rank0_of_n_holds_what_the_memory_model_predicts(script, extra, variant, world,
                                                         rung_runs, request):
    proc = rung_runs[request.node.callspec.id].result()
    check_ok(proc)
    # every line says it is a simulation, and none is a training result
    assert all(line.startswith(f"simulation, rank 0 of {world}: ")
               for line in proc.stdout.splitlines()), proc.stdout
    assert "[METRIC]" not in proc.stdout and "Accuracy" not in proc.stdout
    held = _held(proc.stdout)
    assert held["world_size"] == str(world)
    expected = _predicted(script, extra, variant, world, "resnet50", 200)
    for key, want in (("params_mib", expected.params), ("grads_mib", expected.grads),
                      ("optimizer_mib", expected.optimizer), ("host_mib", expected.host)):
        got = float(held[key]) * memory.MIB
        assert got == pytest.approx(want, rel=0.01, abs=2e-3 * memory.MIB), (key, got, want)
    if script == "fsdp_train.py":  # the memory model's units in flight: two, or all of them
        assert held["units_in_flight"] == ("16" if variant == "grad-op" else "2")


@pytest.fixture(scope="module")
def cnn_runs(request):
    return runs_two_at_a_time(
        request, "test_the_cifar_cnn_with_its_in_place_relu_is_simulated",
        lambda case: run_script("fsdp_train.py", ["--model", "cnn", "--batch-size", "2",
                                                  "--synthetic-size", "8", "--num-workers", "0",
                                                  "--amp", "off", "--simulate-world-size", "4",
                                                  *case["extra"]], timeout=120))


@pytest.mark.parametrize("extra, variant, in_flight", [
    (["--sharding", "full"], "full", "2"), (["--sharding", "grad-op"], "grad-op", "6"),
    (["--offload"], "offload", "2")])
def test_the_cifar_cnn_with_its_in_place_relu_is_simulated(extra, variant, in_flight,
                                                          cnn_runs, request):
    """The CIFAR-10 CNN changes each convolution's output in place (ReLU(inplace=True)). The
    count of units in flight once used full backward hooks, whose view of a unit's output
    autograd refuses to see changed in place: the run crashed at the first step."""
    proc = cnn_runs[request.node.callspec.id].result()
    check_ok(proc)
    held = _held(proc.stdout)
    expected = _predicted("fsdp_train.py", extra + ["--amp", "off"], variant, 4, "cnn", 10,
                          (3, 32, 32))
    for key, want in (("params_mib", expected.params), ("host_mib", expected.host)):
        assert float(held[key]) * memory.MIB == pytest.approx(want, rel=0.01, abs=2e-3 *
                                                              memory.MIB), (key, held[key])
    # four convolutions and two linear layers: all six stay gathered under grad-op
    assert held["units_in_flight"] == in_flight


def test_a_simulation_trains_its_two_steps_and_says_when_it_could_not():
    """--max-steps-per-epoch 1 with --data-on-device held one batch, and the simulation then
    trained one step and said two: its peak was that of a step before the optimizer's state.
    It holds every batch of its share now; a share of one batch is said, not hidden."""
    cnn = ["--model", "cnn", "--batch-size", "16", "--num-workers", "0", "--amp", "off",
           "--simulate-world-size", "2", "--data-on-device"]
    proc = run_script("ddp_train.py", cnn + ["--synthetic-size", "64",
                                             "--max-steps-per-epoch", "1"], timeout=300)
    check_ok(proc)
    assert "2 step(s) trained as rank 0 of 2" in proc.stdout and "note: rank 0" not in proc.stdout
    proc = run_script("ddp_train.py", cnn + ["--synthetic-size", "32"], timeout=300)
    check_ok(proc)
    assert "1 step(s) trained as rank 0 of 2" in proc.stdout
    assert "note: rank 0's share of the data made 1 batch(es), not 2" in proc.stdout


def test_vit_is_sharded_by_its_encoder_blocks_and_holds_an_eighth_of_itself_at_8():
    """torchvision's ViT once became a single FSDP unit (its whole encoder): no saving. Its 12
    encoder blocks are the units now, and rank 0 of 8 holds 1/8 of the parameters, with two
    blocks gathered at a time."""
    import fsdp_train
    vit = torchvision.models.vit_b_16()
    units = fsdp_train.shard_units(vit)
    assert Counter(type(u).__name__ for u in units) == {"EncoderBlock": 12}
    total = sum(p.numel() * 4 for p in vit.parameters())
    proc = run_script("fsdp_train.py", ["--model", "vit_b_16", "--image-size", "224",
                                        "--batch-size", "1", "--synthetic-size", "16",
                                        "--num-workers", "0", "--amp", "off",
                                        "--simulate-world-size", "8"], timeout=600)
    check_ok(proc)
    held = _held(proc.stdout)
    assert float(held["params_mib"]) * memory.MIB == pytest.approx(total / 8, rel=0.01)
    assert held["units_in_flight"] == "2"


def test_repeated_blocks_of_other_models_become_units():
    import fsdp_train
    kinds = {name: Counter(type(u).__name__ for u in fsdp_train.shard_units(
        getattr(torchvision.models, name)())) for name in ("resnet50", "convnext_tiny", "swin_t")}
    assert kinds["resnet50"] == {"Bottleneck": 16}
    assert kinds["convnext_tiny"]["CNBlock"] == 18
    assert kinds["swin_t"]["SwinTransformerBlock"] == 12
    # the small models: every layer with weights, as before
    cnn = models.build_model("cnn", 10, (3, 32, 32))
    assert [type(u).__name__ for u in fsdp_train.shard_units(cnn)] == ["Conv2d"] * 4 + ["Linear"] * 2


@pytest.fixture(scope="module")
def refusals(request):
    return runs_two_at_a_time(
        request, "test_simulate_refuses_what_it_cannot_simulate",
        lambda case: run_script(case["script"], ["--model", "cnn", "--num-workers", "0",
                                                 *case["args"]], timeout=120))


@pytest.mark.parametrize("script, args, message", [
    # no "simulation, rank 0 of 4:" prefix: nothing is simulated
    ("dp_train.py", ["--simulate-world-size", "4"], "error: --simulate-world-size simulates "
     "the ranks of a process group, and DataParallel has none"),
    ("ddp_train.py", ["--simulate-world-size", "1"], "at least 2, got 1"),
    ("ddp_train.py", ["--simulate-world-size", "4", "--checkpoint-dir", "x", "--save-model",
                      "m.pt"], "drop --checkpoint-dir and --save-model"),
    ("fsdp_train.py", ["--simulate-world-size", "4", "--sharding", "hybrid"],
     # its error line too says it is a simulation, as every other line does
     "error: simulation, rank 0 of 4: --simulate-world-size simulates one node's ranks: use "
     "--sharding full or grad-op"),
])
def test_simulate_refuses_what_it_cannot_simulate(script, args, message, refusals, request):
    proc = refusals[request.node.callspec.id].result()
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_simulated_run_names_itself_in_its_error_lines(capsys):
    env = distributed.DistEnv(0, 0, 8, 1, "simulated", num_nodes=1)
    assert faults.crashed(RuntimeError("boom"), env) == 1
    assert ("error: simulation, rank 0 of 8: the run stopped on an unexpected RuntimeError "
            "(boom)") in capsys.readouterr().err
    faults.collective_failed(RuntimeError("gloo"), env)
    assert capsys.readouterr().err.startswith("error: simulation, rank 0 of 8: a collective")
    faults.crashed(RuntimeError("boom"), distributed.DistEnv(1, 1, 2, 2, "torchrun"))
    assert "error: rank 1: the run stopped" in capsys.readouterr().err


def test_a_simulated_runs_layout_line_says_what_it_is():
    """It said 'world_size=4 nodes=1 processes_per_node=1 backend=gloo': four ranks on one node
    cannot be one process per node, and the process group is torch's fake one, not gloo's."""
    import argparse
    import torch
    from training import common
    env = distributed.DistEnv(0, 0, 4, 1, "simulated", num_nodes=1)
    lines = common.provenance(argparse.Namespace(amp="off", checkpoint_dir=None), env,
                              torch.device("cpu"), "gloo")
    assert [ln for ln in lines if ln.startswith("layout:")] == [
        "layout: this one process as rank 0 of world_size=4 (simulated: torch's fake process "
        "group, no collective runs) device=cpu"]


def test_simulate_refuses_several_processes():
    proc = run_script("ddp_train.py", ["--model", "cnn", "--num-workers", "0",
                                       "--simulate-world-size", "4"], nproc=2, timeout=300)
    assert proc.returncode != 0  # torchrun's own code for a worker's exit 2
    assert re.search(r"start it with python, not with 2 processes", proc.stderr)


# ---- ranks that share a GPU (--share-gpus): gloo, round-robin
@pytest.mark.parametrize("visible, local_rank, local_world, source, expected", [
    (1, 1, 2, "torchrun", 0), (1, 0, 2, "torchrun", 0), (2, 3, 4, "torchrun", 1),
    (2, 2, 3, "slurm", 0)])
def test_shared_gpus_are_taken_round_robin(visible, local_rank, local_world, source, expected):
    from training import distributed
    assert distributed.gpu_index(visible, local_rank, local_world, source, share=True) == expected


def test_ranks_share_gpus_only_when_asked_and_outnumbering_them():
    from training import distributed
    env = distributed.DistEnv(0, 0, 2, 2, "torchrun")
    assert distributed.sharing_gpus(1, env, share=True)
    assert not distributed.sharing_gpus(1, env, share=False)
    assert not distributed.sharing_gpus(2, env, share=True)  # a GPU each: NCCL as usual
    # srun tasks that each see one GPU (--gpus-per-task=1) have their own
    assert not distributed.sharing_gpus(1, distributed.DistEnv(0, 0, 2, 2, "slurm"), True)
    line = distributed.shared_gpu_lines(1, env)[0]
    assert "2 processes share 1 GPU(s)" in line and "gloo" in line and "slow" in line


# Two ranks on gloo (CPU tensors: the probe and the mesh do not depend on the device). The
# mesh: torch 2.5 to 2.9 give a 1-D mesh over a gloo group, where CUDA is available, a group
# of its own on "cpu:gloo,cuda:nccl", which ranks sharing a GPU cannot use. Faked here: CUDA
# "available", and each group torch's mesh code makes recorded (and made on gloo: this CPU
# has no NCCL). The probe: the real collectives, then gloo's reduce-scatter as it was before
# torch 2.9 (faked: a sum where the average was asked), then one collective gloo lacks.
MESH_AND_PROBE = """
import sys
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
from torch.distributed import device_mesh
import fsdp_train
from training import distributed
from training.faults import UsageError, end_process

torch.cuda.is_available = lambda: True
made_by_torch, new_group = [], dist.new_group
def old_torchs_new_group(*args, **kwargs):
    made_by_torch.append(kwargs.get("backend") or "cpu:gloo,cuda:nccl")
    return new_group(*args, **dict(kwargs, backend="gloo"))
device_mesh.new_group = old_torchs_new_group

args = fsdp_train.build_parser().parse_args(["--device", "cpu"])
_, backend, mesh = fsdp_train.setup_distributed(args, distributed.dist_env())
rank = dist.get_rank()
log = open(f"{out}/rank{{rank}}.txt", "w")  # each rank its own: their prints would interleave
print("full", mesh.get_group("shard") is dist.group.WORLD, made_by_torch, file=log)
nodes = distributed.DistEnv(rank, 0, 2, 1, "torchrun", num_nodes=2)  # 2 nodes of 1 rank
hybrid = fsdp_train.build_mesh("cpu", backend, nodes, "hybrid", 60)
print("hybrid", tuple(hybrid.shape), [(dist.get_backend(hybrid.get_group(d)),
      hybrid.get_group(d).size()) for d in ("replicate", "shard")], made_by_torch, file=log)

uses = [("all_gather", mesh.get_group("shard")), ("reduce_scatter_avg", mesh.get_group("shard")),
        ("all_reduce", None), ("broadcast", None),
        ("all_reduce_avg", hybrid.get_group("replicate"))]
distributed.check_gloo_on_cuda(torch.device("cpu"), uses)
print("probe passes", file=log)
reduce_scatter = dist.reduce_scatter_tensor
dist.reduce_scatter_tensor = lambda out, inp, op=None, group=None: reduce_scatter(
    out, inp, op=dist.ReduceOp.SUM, group=group)
try:
    distributed.check_gloo_on_cuda(torch.device("cpu"), uses)
except UsageError as e:
    print("wrong average:", e, file=log)
def missing(*args, **kwargs):
    raise RuntimeError("ProcessGroupGloo::reduce_scatter: unsupported device type cuda")
dist.reduce_scatter_tensor = missing
try:
    distributed.check_gloo_on_cuda(torch.device("cpu"), uses)
except UsageError as e:
    print("missing:", e, file=log)
log.close()
dist.destroy_process_group()
end_process(0)  # as the scripts end (training/faults.py says why)
"""


def test_the_fsdp_mesh_stays_on_the_given_group_and_the_probe_checks_its_values(tmp_path):
    script = tmp_path / "mesh_and_probe.py"
    script.write_text(MESH_AND_PROBE.format(repo=str(REPO), out=str(tmp_path)))
    proc = run_script(str(script), nproc=2, timeout=300)
    check_ok(proc)
    out = [line for rank in (0, 1)
           for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    # the 1-D mesh is the ranks' own group, and torch's mesh code made no group of its own
    assert out.count("full True []") == 2, out
    # HSDP: 2 nodes of 1 rank, both dimensions on groups made on the given backend
    assert out.count("hybrid (2, 1) [('gloo', 2), ('gloo', 1)] []") == 2, out
    assert out.count("probe passes") == 2, out
    wrong = [line for line in out if line.startswith("wrong average:")]
    assert len(wrong) == 2, out
    assert re.fullmatch(r"wrong average: --share-gpus: gloo's reduce_scatter_avg of CUDA "
                        r"tensors in this torch returned \[\d.*\] on rank \d where \[.*\] is "
                        r"due, so training on it would go wrong: start one process per GPU, "
                        r"without --share-gpus", wrong[0]), wrong[0]
    missing = ("missing: --share-gpus: gloo in this torch has no reduce_scatter_avg for CUDA "
               "tensors (ProcessGroupGloo::reduce_scatter: unsupported device type cuda), which "
               "this strategy needs: start one process per GPU, without --share-gpus")
    assert out.count(missing) == 2, out


def test_share_gpus_is_for_process_groups():
    proc = run_script("dp_train.py", ["--model", "cnn", "--share-gpus"], timeout=120)
    assert proc.returncode == 2 and "DataParallel is one process" in proc.stderr
