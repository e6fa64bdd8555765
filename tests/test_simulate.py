"""--simulate-world-size N (training/simulate.py): one process as rank 0 of N on torch's fake
process group holds what one GPU of N holds, which is what the memory model predicts; and FSDP
shards the blocks that repeat, for any model."""

from __future__ import annotations

import importlib
import re
from collections import Counter

import pytest
import torchvision

from conftest import check_ok, run_script
from training import contract, memory, models

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
    saved = memory.Saved(0, 0, 0, shape, "off", classes)
    return module.memory_per_gpu(model, args, world, saved, variant)


@pytest.mark.parametrize("world", [2, 8, 64])
@pytest.mark.parametrize("script, extra, variant", RUNGS, ids=[v for _, _, v in RUNGS])
def test_rank0_of_n_holds_what_the_memory_model_predicts(script, extra, variant, world):
    proc = run_script(script, ["--model", "resnet50", "--batch-size", "2", "--synthetic-size",
                               str(4 * world), "--num-workers", "0", "--amp", "off",
                               "--simulate-world-size", str(world)] + extra, timeout=300)
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


@pytest.mark.parametrize("extra, variant, in_flight", [
    (["--sharding", "full"], "full", "2"), (["--sharding", "grad-op"], "grad-op", "6"),
    (["--offload"], "offload", "2")])
def test_the_cifar_cnn_with_its_in_place_relu_is_simulated(extra, variant, in_flight):
    """The CIFAR-10 CNN changes each convolution's output in place (ReLU(inplace=True)). The
    count of units in flight once used full backward hooks, whose view of a unit's output
    autograd refuses to see changed in place: the run crashed at the first step."""
    proc = run_script("fsdp_train.py", ["--model", "cnn", "--batch-size", "2",
                                        "--synthetic-size", "8", "--num-workers", "0",
                                        "--amp", "off", "--simulate-world-size", "4"] + extra,
                      timeout=120)
    check_ok(proc)
    held = _held(proc.stdout)
    expected = _predicted("fsdp_train.py", extra + ["--amp", "off"], variant, 4, "cnn", 10,
                          (3, 32, 32))
    for key, want in (("params_mib", expected.params), ("host_mib", expected.host)):
        assert float(held[key]) * memory.MIB == pytest.approx(want, rel=0.01, abs=2e-3 *
                                                              memory.MIB), (key, held[key])
    # four convolutions and two linear layers: all six stay gathered under grad-op
    assert held["units_in_flight"] == in_flight


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


@pytest.mark.parametrize("script, args, message", [
    ("dp_train.py", ["--simulate-world-size", "4"], "DataParallel has none"),
    ("ddp_train.py", ["--simulate-world-size", "1"], "at least 2, got 1"),
    ("ddp_train.py", ["--simulate-world-size", "4", "--checkpoint-dir", "x", "--save-model",
                      "m.pt"], "drop --checkpoint-dir and --save-model"),
    ("fsdp_train.py", ["--simulate-world-size", "4", "--sharding", "hybrid"],
     "use --sharding full or grad-op"),
])
def test_simulate_refuses_what_it_cannot_simulate(script, args, message):
    proc = run_script(script, ["--model", "cnn", "--num-workers", "0"] + args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


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


def test_a_collective_gloo_lacks_for_cuda_tensors_is_one_sentence(monkeypatch):
    from training import distributed
    from training.faults import UsageError
    import torch.distributed as dist
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for op in ("all_reduce", "broadcast", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, op, lambda *a, **k: None)

    def missing(*a, **k):
        raise RuntimeError("ProcessGroupGloo::reduce_scatter: unsupported device type cuda")
    monkeypatch.setattr(dist, "reduce_scatter_tensor", missing)
    distributed.check_gloo_on_cuda("cpu", ("all_reduce", "broadcast"))  # DDP's: all there
    with pytest.raises(UsageError, match=r"^--share-gpus: gloo in this torch has no "
                                         r"reduce_scatter for CUDA tensors \(ProcessGroupGloo"
                                         r".*\), which this strategy needs: start one process "
                                         r"per GPU, without --share-gpus$"):
        distributed.check_gloo_on_cuda("cpu", ("all_gather", "reduce_scatter", "all_reduce"))


def test_share_gpus_is_for_process_groups():
    proc = run_script("dp_train.py", ["--model", "cnn", "--share-gpus"], timeout=120)
    assert proc.returncode == 2 and "DataParallel is one process" in proc.stderr
