"""The private torch internals of training/torch_private.py, used on the installed torch: when a
torch release moves one, these tests fail here, by name, before a run's straggler figures
silently go missing. One process, a gloo group of one, tiny models: a few seconds."""

from __future__ import annotations

import re
import signal

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import REPO
from training import simulate, torch_private


@pytest.fixture
def group_of_one():
    """A gloo process group of this one process, torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _counting(calls: list):
    """A wrap that records each call of the method it wraps, by name."""
    def wrap(method):
        def counted(*args, **kwargs):
            calls.append(method.__name__)
            return method(*args, **kwargs)
        return counted
    return wrap


def test_fsdp_param_groups_and_their_methods_are_where_torch_keeps_them(group_of_one):
    """Each unit fully_shard made has its parameter group, and the four methods stragglers.py
    times are still the ones FSDP calls in a training step."""
    from torch.distributed.fsdp import fully_shard
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    names = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")
    calls = []
    for unit in (model[0], model[2]):
        (group,) = torch_private.fsdp_param_groups(unit)
        torch_private.wrap_fsdp_group_methods(group, names, _counting(calls))
    assert torch_private.fsdp_param_groups(model) == []  # the root holds no parameters itself
    model(torch.randn(4, 8)).sum().backward()
    assert set(calls) == set(names), f"FSDP no longer calls {set(names) - set(calls)}"


def test_zero_broadcast_is_where_torch_keeps_it(group_of_one):
    """ZeroRedundancyOptimizer still broadcasts the updated parameters through the method
    stragglers.py times, once per step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = nn.Linear(8, 2)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                        lr=0.1)
    calls = []
    torch_private.wrap_zero_broadcast(optimizer, _counting(calls))
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    assert calls == ["_sync_params"]


def test_an_fsdp_units_dtensor_is_counted_by_its_local_shard(group_of_one):
    """DTensor is imported where simulate.py uses it, as FSDPModule and ZeroRedundancyOptimizer
    are where stragglers.py and ddp_train.py use them, so that a refusal of a flag or a --help
    does not load them: an FSDP unit's weight is still seen as a DTensor and counted by its
    local shard, a plain weight as it is."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    unit, plain = fully_shard(nn.Linear(8, 2)), nn.Linear(8, 2)
    assert isinstance(unit.weight, DTensor)
    local = simulate._local(unit.weight)
    assert not isinstance(local, DTensor) and torch.equal(local, unit.weight.to_local())
    assert simulate._local(plain.weight) is plain.weight


def test_ddps_builtin_allreduce_hook_divides_once_a_bucket(group_of_one):
    """Without a comm hook DDP divides each parameter's gradient by the world size on its own;
    with the built-in all-reduce hook it divides each bucket once, and the gradients are the
    same."""
    grads = {}
    for hooked in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        replica = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        if hooked:
            torch_private.ddp_average_per_bucket(replica)
        x = torch.randn(4, 8)
        replica(x).sum().backward()  # the first backward builds the buckets
        with torch.profiler.profile() as prof:
            replica(x).sum().backward()
        divisions = [e for e in prof.events() if e.name in ("aten::div_", "aten::mul_out")]
        assert len(divisions) == (1 if hooked else 4), [e.name for e in divisions]
        grads[hooked] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


@pytest.mark.parametrize("call, name", [
    (lambda: torch_private.ddp_average_per_bucket(nn.Linear(2, 2)),
     "DistributedDataParallel._register_builtin_comm_hook"),
    (lambda: torch_private.fsdp_param_groups(nn.Linear(2, 2)), "FSDPModule._get_fsdp_state"),
    (lambda: torch_private.fsdp_param_groups(type("Unit", (), {"_get_fsdp_state": object})()),
     "FSDPState._fsdp_param_groups"),
    (lambda: torch_private.wrap_fsdp_group_methods(object(), ("unshard",), id),
     "FSDPParamGroup.unshard"),
    (lambda: torch_private.wrap_zero_broadcast(torch.optim.SGD([nn.Parameter(torch.ones(1))]),
                                               id), "ZeroRedundancyOptimizer._sync_params"),
])
def test_a_moved_internal_is_one_sentence_naming_it_and_the_checked_versions(call, name):
    with pytest.raises(torch_private.TorchInternalMoved) as moved:
        call()
    text = str(moved.value)
    assert text.startswith(f"{name} is gone from torch {torch.__version__} (checked on torch ")
    assert "training/torch_private.py" in text and "\n" not in text


def test_a_group_missing_one_method_is_left_as_it_was():
    class Group:
        def unshard(self):
            return "unshard"
    group = Group()
    with pytest.raises(torch_private.TorchInternalMoved, match="wait_for_unshard"):
        torch_private.wrap_fsdp_group_methods(group, ("unshard", "wait_for_unshard"), id)
    assert group.unshard() == "unshard"


def test_torchruns_stop_handler_is_where_torch_keeps_it_and_acts_once(monkeypatch):
    """torchrun's agent installs the module's handler by name; after torchrun_stops_once the
    first stop signal still raises torch's SignalException (the agent's shutdown), a repeat
    returns without a word. launch/torchrun_once.py runs torchrun so."""
    from torch.distributed.elastic.multiprocessing import api
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    torch_private.torchrun_stops_once()
    with pytest.raises(api.SignalException):
        api._terminate_process_handler(signal.SIGTERM, None)
    assert api._terminate_process_handler(signal.SIGTERM, None) is None
    assert api._terminate_process_handler(signal.SIGINT, None) is None


def test_a_moved_torchrun_handler_is_one_sentence(monkeypatch):
    from torch.distributed.elastic.multiprocessing import api
    monkeypatch.delattr(api, "_terminate_process_handler")
    with pytest.raises(torch_private.TorchInternalMoved, match="^torch.distributed.elastic."
                       "multiprocessing.api._terminate_process_handler is gone from torch "):
        torch_private.torchrun_stops_once()


def test_stragglers_reach_these_internals_only_through_torch_private():
    private = re.compile(r"_get_fsdp_state|_fsdp_param_groups?\b|_sync_params")
    text = (REPO / "training" / "stragglers.py").read_text(encoding="utf-8")
    found = [n for n, line in enumerate(text.splitlines(), 1) if private.search(line)]
    assert not found, f"training/stragglers.py names private torch internals on lines {found}"
