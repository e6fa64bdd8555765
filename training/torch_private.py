"""The private torch internals this project reaches into, each behind one function.

A private name can move in any torch release without notice. Kept here, each one is found in
one place, names the torch versions it was checked on, and says in one sentence when this torch
no longer has it (``TorchInternalMoved``), instead of an AttributeError deep in a run or a
measurement that silently stops. tests/test_torch_private.py uses each on the installed torch,
so a torch that moves one fails there first.

- ``fsdp_param_groups``: the parameter groups FSDP2's ``fully_shard`` made for a module;
- ``wrap_fsdp_group_methods``: a wrapper around some of a parameter group's methods (its
  unshard, its wait for it, its post-backward), which issue or wait for the collectives;
- ``wrap_zero_broadcast``: a wrapper around ZeroRedundancyOptimizer's broadcast of the updated
  parameters after its step;
- ``torchrun_stops_once``: torchrun's handler for its stop signals, made to act on the first;
- ``ddp_average_per_bucket``: DDP's built-in all-reduce comm hook, which averages each gradient
  bucket in one division.

stragglers.py times the waits for other ranks with the first three; launch/torchrun_once.py
runs torchrun with the fourth; ddp_train.py uses the last.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: The torch versions each internal was checked on: 2.9.0 and 2.14.1 on the CPU (the oldest
#: torch requirements.txt allows, and the one installed here), 2.11 on the GPU.
FSDP_STATE_CHECKED = "2.9.0, 2.11 and 2.14.1"  # FSDPModule._get_fsdp_state, its param groups
FSDP_GROUP_CHECKED = "2.9.0, 2.11 and 2.14.1"  # FSDPParamGroup's unshard ... finalize_backward
ZERO_BROADCAST_CHECKED = "2.9.0, 2.11 and 2.14.1"  # ZeroRedundancyOptimizer._sync_params
TORCHRUN_SIGNAL_CHECKED = "2.14.1"  # elastic.multiprocessing.api._terminate_process_handler
DDP_BUILTIN_HOOK_CHECKED = "2.9.0 and 2.14.1"  # DDP._register_builtin_comm_hook; not on a GPU


class TorchInternalMoved(RuntimeError):
    """A private torch name this project uses is gone from the installed torch."""


def _moved(name: str, checked: str) -> TorchInternalMoved:
    return TorchInternalMoved(f"{name} is gone from torch {torch.__version__} (checked on torch "
                              f"{checked}): training/torch_private.py needs updating for it")


def fsdp_param_groups(unit) -> list:
    """The parameter groups FSDP2 made for ``unit``, a module ``fully_shard`` wrapped: one at
    most on torch 2.9 (``_fsdp_param_group``), a list on later ones (``_fsdp_param_groups``);
    [] for a unit that holds no parameters of its own."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    if not callable(get_state):
        raise _moved("FSDPModule._get_fsdp_state", FSDP_STATE_CHECKED)
    state = get_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [group] if group is not None else []
    raise _moved("FSDPState._fsdp_param_groups", FSDP_STATE_CHECKED)


def wrap_fsdp_group_methods(group, names: tuple, wrap) -> None:
    """Replace each method ``names`` of FSDP2's parameter ``group`` by ``wrap(method)``; all
    or none: a group that lacks one is left as it was."""
    missing = [name for name in names if not callable(getattr(group, name, None))]
    if missing:
        raise _moved(f"FSDPParamGroup.{missing[0]}", FSDP_GROUP_CHECKED)
    for name in names:
        setattr(group, name, wrap(getattr(group, name)))


def wrap_zero_broadcast(optimizer, wrap) -> None:
    """Replace ZeroRedundancyOptimizer's ``_sync_params`` (after its step, each rank broadcasts
    its partition of the updated parameters and receives the others') by ``wrap(it)``."""
    sync = getattr(optimizer, "_sync_params", None)
    if not callable(sync):
        raise _moved("ZeroRedundancyOptimizer._sync_params", ZERO_BROADCAST_CHECKED)
    optimizer._sync_params = wrap(sync)


def torchrun_stops_once() -> None:
    """Make torchrun's agent, run in this process, act on its first stop signal only.

    Its handler for SIGTERM, SIGINT, SIGHUP and SIGQUIT (``_terminate_process_handler``, which
    the agent installs when it starts the workers) raises on every signal. A second one lands
    in the agent's shutdown and cuts it short: inside its logging call ("--- Logging error ---")
    or in its wait for the workers, which it then signals again. The agent looks the handler up
    by name when it installs it, so replacing the module's function is enough."""
    from torch.distributed.elastic.multiprocessing import api
    handler = getattr(api, "_terminate_process_handler", None)
    if not callable(handler):
        raise _moved("torch.distributed.elastic.multiprocessing.api._terminate_process_handler",
                     TORCHRUN_SIGNAL_CHECKED)
    stopping = []

    def first_only(signum, frame):
        # Nothing is printed for a repeat: a print here could land inside another write to the
        # same stream and fail there, which is the very thing this avoids.
        if stopping:
            return  # the agent is already stopping its workers, within its own timeout
        stopping.append(signum)
        handler(signum, frame)

    api._terminate_process_handler = first_only


def ddp_average_per_bucket(replica) -> None:
    """Give DDP ``replica`` its built-in all-reduce comm hook (``_register_builtin_comm_hook``,
    ALLREDUCE: divide the bucket by the world size, then all-reduce it). Without any hook, DDP
    divides each parameter's gradient on its own as it lands in its bucket, one kernel a
    parameter (161 a ResNet-50 step, even at world size 1); a hook divides each bucket once.
    The same all-reduce, the same average."""
    register = getattr(replica, "_register_builtin_comm_hook", None)
    kind = getattr(getattr(dist, "BuiltinCommHookType", None), "ALLREDUCE", None)
    if not callable(register) or kind is None:
        raise _moved("DistributedDataParallel._register_builtin_comm_hook",
                     DDP_BUILTIN_HOOK_CHECKED)
    register(kind)
