"""Where a hang sits: every rank's last collectives on record, and the lines that name them.

Each rank of a multi-process run appends one line per collective it enters to its own small
file (``collectives-rank<R>.txt`` in ``record_dir()``): the sequence number, the kind, its
size, the training step and the code's phase (forward, backward.bucketN, optimizer,
evaluation, checkpoint). On NCCL, PyTorch's flight recorder keeps the same facts for every
collective, those DDP issues from C++ included, and dumps them into the same folder on a
timeout (``flight_recorder_env``). When a collective times out (common.run) or the watchdog
ends a frozen rank, ``report`` reads every rank's record, from either source, and prints

    [HANG] rank=1 node=n01 gpu=cuda:1 waits_in=all_reduce seq=412 numel=... bytes=...
           step=37 phase=backward.bucket3   (one line, cut here)
    [HANG] first_disagreement seq=412 rank0=all_reduce/2359296/backward.bucket3
           rank1=all_reduce/6/evaluation   (one line, cut here)

A rank that sits in no collective (a loop, a lock, a wait on the GPU) says where it is itself:
STACKS_SIGNAL (SIGUSR2) makes it print every thread's Python stack and go on
(``print_stacks_on_signal``, which common.run installs); the watchdog sends it before it ends
a rank that went silent.

The module imports the standard library only, so the watchdog (``python -m training.watchdog``)
can read the records without torch; ``watch`` imports torch when a run installs the record.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import os
import platform
import signal
import tempfile
import time
from pathlib import Path

#: Lines of a rank's record file before it starts a new one (the previous file is kept): a
#: ring of two files, so a long run's record stays small.
RECORD_LINES = 5000

#: Entries of the NCCL flight recorder's ring (TORCH_FR_BUFFER_SIZE), when the user set none.
FLIGHT_RECORDER_ENTRIES = 2000

#: The flight recorder's dump files: this prefix, then the rank (torch's own naming).
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"

#: The collectives of torch.distributed the record wraps, and which argument holds the input.
COLLECTIVES = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1,
               "all_gather_into_tensor": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
               "all_to_all_single": 1, "all_gather_single": 1, "reduce_scatter_single": 1,
               "gather": 0, "scatter": 1, "barrier": None,
               "all_gather_object": None, "broadcast_object_list": None, "gather_object": None}


def record_dir() -> Path:
    """Where the ranks keep their records: $RUN_DIR/collectives under the launchers (the run's
    folder, on the shared file system, so one node can read every node's record); else a
    folder in the temporary directory named for this launch (torchrun's run id and the
    rendezvous port), which every local rank and its watchdog find from the environment."""
    if os.environ.get("RUN_DIR"):
        return Path(os.environ["RUN_DIR"]) / "collectives"
    launch = "-".join(os.environ.get(name, "0") for name in
                      ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_PORT"))
    user = os.environ.get("USER") or str(os.getuid())
    return Path(tempfile.gettempdir()) / f"collectives-{user}-{launch}"


def flight_recorder_env() -> None:
    """Turn PyTorch's flight recorder on for NCCL (unless the user set it): a ring of the last
    collectives of every rank, dumped into record_dir() when a collective times out. Set before
    the process group is created, which reads it; gloo ignores it."""
    folder = record_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # torch reads TORCH_FR_BUFFER_SIZE, else the older TORCH_NCCL_TRACE_BUFFER_SIZE
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / FLIGHT_RECORDER_PREFIX))


# --------------------------------------------------------------------------------------------
# The record: each rank appends as it enters a collective
# --------------------------------------------------------------------------------------------


class Record:
    """This rank's record file: a header line (rank, node, GPU), then one line per event:
    ``seq kind numel bytes step phase`` as it enters a collective (and `` group`` after it
    where the group is not the run's own, "0": --sharding hybrid's subgroups; each group
    counts its collectives from 1, as NCCL's flight recorder does), ``seq done`` when a
    blocking one returns, ``- step phase`` when the code's phase changes. Appended with one
    unbuffered write each (no host sync: sizes come from the tensors' shapes); rolled over
    every RECORD_LINES lines."""

    def __init__(self, folder: Path, rank: int, device: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"collectives-rank{rank}.txt"
        self.header = f"rank={rank} node={platform.node()} gpu={device} pid={os.getpid()}\n"
        # a previous attempt's (a requeue) would mislead
        for old in (self.path, self.path.with_suffix(".old"),
                    folder / f"{FLIGHT_RECORDER_PREFIX}{rank}"):
            old.unlink(missing_ok=True)
        (folder / REPORTED).unlink(missing_ok=True)
        self.fd = self._open()
        self.rank, self.step, self.phase, self.lines = rank, 0, "start", 0
        self.seqs = {}  # group -> its collectives so far

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        os.write(fd, self.header.encode())
        return fd

    def _write(self, line: str) -> None:
        if self.lines == RECORD_LINES:
            os.close(self.fd)
            os.replace(self.path, self.path.with_suffix(".old"))
            self.fd, self.lines = self._open(), 0
        os.write(self.fd, line.encode())
        self.lines += 1

    def enter(self, kind: str, numel, nbytes, group: str = "0") -> int:
        seq = self.seqs[group] = self.seqs.get(group, 0) + 1
        place = "" if group == "0" else f" {group}"
        self._write(f"{seq} {kind} {numel} {nbytes} {self.step} {self.phase}{place}\n")
        return seq

    def done(self, seq: int) -> None:
        self._write(f"{seq} done\n")

    def set_phase(self, phase: str, step: int | None = None) -> None:
        if phase != self.phase or step not in (None, self.step):
            self.phase, self.step = phase, self.step if step is None else step
            self._write(f"- {self.step} {self.phase}\n")


_record: Record | None = None


def forget() -> None:
    """An end with no hang to name (every rank past the last barrier, or an error that ends
    the rank on its own: a usage error, a NaN loss): this rank's record goes, and the folder
    once it is empty, which the last rank's turn finds (one of a run without the launchers
    would otherwise stay in the temporary directory for good, empty too where the run ended
    before its first record)."""
    global _record
    if _record is not None:
        os.close(_record.fd)
        for path in (_record.path, _record.path.with_suffix(".old")):
            path.unlink(missing_ok=True)
        _record = None
    try:
        record_dir().rmdir()  # only when empty: another rank's record, or a hang's dump, stays
    except OSError:
        pass


#: The signal on which a training process prints every thread's Python stack to its stderr
#: and goes on (faulthandler): where a rank sits that is in no collective. Its default action
#: ends a process, so it only goes to processes that catch it (``catches_stacks_signal``).
STACKS_SIGNAL = signal.SIGUSR2


def print_stacks_on_signal() -> None:
    """From now on STACKS_SIGNAL prints this process's Python stacks, every thread's, to its
    stderr (faulthandler: it works even while a thread holds the GIL in C code). File
    descriptor 2, not sys.stderr, which a test's capture may have replaced."""
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)


def catches_stacks_signal(pid: int) -> bool:
    """Whether process ``pid`` has a handler for STACKS_SIGNAL (the SigCgt mask of
    /proc/PID/status): the training processes do, torchrun and the shells around them do not,
    and the signal would end them."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration, IndexError):
        return False
    return bool(int(caught, 16) >> (STACKS_SIGNAL - 1) & 1)


def ask_for_stacks(pids: list, wait_s: float = 0.5) -> list:
    """Send STACKS_SIGNAL to those of ``pids`` that catch it, one after another with
    ``wait_s`` for each to write (processes sharing a stderr would interleave their lines);
    returns those asked."""
    asked = []
    for pid in pids:
        if catches_stacks_signal(pid):
            try:
                os.kill(pid, STACKS_SIGNAL)
            except ProcessLookupError:
                continue
            asked.append(pid)
            time.sleep(wait_s)
    return asked


def set_phase(phase: str) -> None:
    """What the code does now, for the next collectives' lines (hooks and the checkpoint call
    it); nothing when no record is kept (one process)."""
    if _record is not None:
        _record.set_phase(phase)


def group_label(name, desc) -> str:
    """How the record and the [HANG] lines name a process group: torch's name (a number,
    the same on every member) and its description where it has one, e.g. "3:shard"; "0":
    the run's own (also for group=None)."""
    name, desc = str(name), str(desc or "")
    return name if name == "0" or desc in ("", "undefined") else f"{name}:{desc}"


def _size(value) -> tuple:
    """(elements, bytes) of a collective's input: a tensor, a list of them, or a list of
    objects (bytes unknown before pickling: -)."""
    if hasattr(value, "numel"):
        return value.numel(), value.numel() * value.element_size()
    if isinstance(value, (list, tuple)) and value and all(hasattr(t, "numel") for t in value):
        return sum(t.numel() for t in value), sum(t.numel() * t.element_size() for t in value)
    return (len(value), "-") if isinstance(value, (list, tuple)) else ("-", "-")


def _wrapped(dist, kind: str, position):
    real = getattr(dist, kind)
    params = list(inspect.signature(real).parameters)

    def argument(name, args, kwargs):  # passed by position or by name; None: not passed
        at = params.index(name) if name in params else len(args)
        return kwargs.get(name, args[at] if at < len(args) else None)

    def collective(*args, **kwargs):
        if _record is None:
            return real(*args, **kwargs)
        data = None if position is None else argument(params[position], args, kwargs)
        numel, nbytes = ("-", "-") if data is None else _size(data)
        group = argument("group", args, kwargs)
        seq = _record.enter(kind, numel, nbytes, group_label(
            getattr(group, "group_name", "0"), getattr(group, "group_desc", "")))
        work = real(*args, **kwargs)
        if not argument("async_op", args, kwargs):  # returned: this rank is past it
            _record.done(seq)
        return work
    collective.recorded = True
    return collective


def watch(step_model, optimizer, device) -> None:
    """Keep this rank's record (a multi-process run; stragglers.watch calls it with the model
    it hooks): every collective the toolkit calls through torch.distributed is noted as it
    is entered, with the phase that the model's forward pre-hook (forward, or evaluation in
    eval mode), a hook on the gradient of its output (backward, as the backward starts: what
    FSDP's gathers and reduce-scatters there get), DDP's comm hook (backward.bucketN), the
    optimizer's step pre-hook and the checkpoint (set_phase) name. DDP's own broadcasts run in
    C++ and are not seen here; on NCCL the flight recorder has them."""
    global _record
    import torch.distributed as dist
    from training.distributed import rank_and_world
    rank, _ = rank_and_world()
    _record = Record(record_dir(), rank, str(device))
    for kind, position in COLLECTIVES.items():  # (FSDP2 calls the *_single ones, newer torch)
        if hasattr(dist, kind) and not getattr(getattr(dist, kind), "recorded", False):
            setattr(dist, kind, _wrapped(dist, kind, position))

    def forward(module, args):
        if module.training:
            _record.set_phase("forward", _record.step + 1)
        else:
            _record.set_phase("evaluation")

    def backward_starts(module, args, output):
        if module.training and getattr(output, "requires_grad", False):
            output.register_hook(lambda grad: set_phase("backward"))  # leaves grad as it is

    step_model.register_forward_pre_hook(forward)
    step_model.register_forward_hook(backward_starts)
    optimizer.register_step_pre_hook(lambda *_: set_phase("optimizer"))


# --------------------------------------------------------------------------------------------
# The report: read every rank's record, name where each one waits
# --------------------------------------------------------------------------------------------


#: Made by the first process that reports, so that each hang is named once, not by every rank.
REPORTED = "reported"


def read_record(path: Path) -> dict:
    """One rank's record file (and its rolled-over predecessor) as {"rank", "node", "gpu",
    "entries": [{"seq", "kind", "numel", "bytes", "step", "phase", "group", "done"}, ...],
    "groups", "now":
    {"step", "phase"} where its last line leaves it outside any collective, else None}."""
    lines = []
    for part in (path.with_suffix(".old"), path):
        if part.exists():
            lines += part.read_text(errors="replace").splitlines()[1:]
    header = dict(f.split("=", 1) for f in path.read_text(errors="replace")
                  .splitlines()[0].split() if "=" in f)
    entries, now = [], None
    for line in lines:
        fields = line.split()
        if len(fields) in (6, 7) and fields[0].isdigit():
            entry = dict(zip(("seq", "kind", "numel", "bytes", "step", "phase", "group"),
                             [int(fields[0])] + fields[1:] + ["0"]), done=False)
            for key in ("numel", "bytes"):  # numbers, as the flight recorder's are ("-": none)
                entry[key] = int(entry[key]) if entry[key].isdigit() else entry[key]
            entries.append(entry)
            now = None
        elif len(fields) == 2 and fields[1] == "done" and entries:
            if entries[-1]["seq"] == int(fields[0]):
                entries[-1]["done"] = True
                now = dict(step=entries[-1]["step"], phase=entries[-1]["phase"])
        elif len(fields) == 3 and fields[0] == "-":
            now = dict(step=fields[1], phase=fields[2])
    return {"rank": int(header.get("rank", -1)), "node": header.get("node", "?"),
            "gpu": header.get("gpu", "?"), "entries": entries, "now": now, "source": "record",
            "groups": {e["group"] for e in entries}}  # those it has entered a collective of


def read_flight_recorder(path: Path) -> dict:
    """One rank's flight-recorder dump (a pickle: "entries" of dicts with profiling_name such
    as "nccl:all_reduce", process_group, collective_seq_id, input_sizes, input_dtypes, state;
    "pg_config": the groups the rank is in), in the shape of read_record. Its collectives are
    those of every process group the rank is in, DDP's C++ ones included: each entry names its
    group ("0": the run's own; --sharding hybrid's shard and replicate groups have others),
    and each group counts its collectives from 1. The step and the phase are not in it (-)."""
    import pickle
    with open(path, "rb") as f:
        dump = pickle.load(f)
    rank = int(path.name[len(FLIGHT_RECORDER_PREFIX):])
    groups = {group_label(name, config.get("desc") if isinstance(config, dict) else "")
              for name, config in (dump.get("pg_config") or {}).items()}  # the rank's
    entries = []
    for e in sorted(dump.get("entries", []), key=lambda e: e.get("record_id", 0)):
        if e.get("is_p2p"):
            continue
        numel = sum(_product(s) for s in e.get("input_sizes", []))
        nbytes = sum(_product(s) * _DTYPE_BYTES.get(d, 0) for s, d in
                     zip(e.get("input_sizes", []), e.get("input_dtypes", [])))
        name, desc = (list(e.get("process_group") or ["0"]) + [""])[:2]  # (name, description)
        group = group_label(name, desc)
        groups.add(group)
        entries.append({"seq": int(e["collective_seq_id"]), "group": group,
                        "kind": e["profiling_name"].split(":", 1)[-1], "numel": numel,
                        "bytes": nbytes or "-", "step": "-", "phase": "-",
                        "state": e.get("state", "?")})
    # the rank waits in its first collective that has not completed, if any
    waiting = [e for e in entries if e["state"] != "completed"]
    if waiting:
        entries = entries[:entries.index(waiting[0]) + 1]
    return {"rank": rank, "node": "?", "gpu": "?", "entries": entries, "groups": groups,
            "now": None if waiting or not entries else {"step": "-", "phase": "-"},
            "source": "flight recorder"}


_DTYPE_BYTES = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Long": 8, "Int": 4,
                "Byte": 1, "Char": 1, "Bool": 1, "Short": 2}


def _product(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def read_all(folder: Path) -> list:
    """Every rank's record in ``folder``, in rank order: the flight recorder's dump where a
    rank has one (it sees every collective), else this module's record."""
    ranks = {}
    for path in sorted(folder.glob("collectives-rank*.txt")):
        record = read_record(path)
        ranks[record["rank"]] = record
    for path in sorted(folder.glob(FLIGHT_RECORDER_PREFIX + "*")):
        if path.name[len(FLIGHT_RECORDER_PREFIX):].isdigit():
            dump = read_flight_recorder(path)
            own = ranks.get(dump["rank"], {})
            ranks[dump["rank"]] = dict(dump, node=own.get("node", "?"), gpu=own.get("gpu", "?"))
    return [ranks[r] for r in sorted(ranks)]


def _signature(entry: dict) -> tuple:
    return entry["kind"], entry["numel"]


def _where(entry: dict, key: str = "") -> str:
    """A collective's place: its sequence number, after its group where that is not the run's
    own ("0"): --sharding hybrid's shard and replicate groups, the stop vote's. ``key``: a
    prefix of both keys (after_)."""
    group = entry.get("group", "0")
    seq = f"{key}seq={entry['seq']}"
    return seq if group == "0" else f"{key}group={group} {seq}"


def first_disagreements(records: list) -> list:
    """For each process group in which the ranks' collectives differ, the first sequence
    number at which they do (another kind or size, or a member that has none there while
    another does), as (group, seq, {rank: entry or None} over the group's members); [] when
    they agree as far as they go. A group's members: every rank for "0", the run's own; for
    the others, those whose flight recorder lists the group, or whose record has entered a
    collective of it."""
    found, groups = [], {}  # group -> the records of its members
    for r in records:
        for group in {"0"} | r["groups"]:
            groups.setdefault(group, []).append(r)
    for group in sorted(groups, key=lambda g: (len(g.split(":")[0]), g)):  # "0", "1", "10"
        members = groups[group]
        by_rank = [{e["seq"]: e for e in r["entries"] if e.get("group", "0") == group}
                   for r in members]
        for seq in sorted(set().union(*by_rank)) if by_rank else []:
            seen = {r["rank"]: ranks.get(seq) for r, ranks in zip(members, by_rank)}
            if len({_signature(e) if e else None for e in seen.values()}) > 1:
                found.append((group, seq, seen))
                break
    return found


def hang_lines(records: list) -> list:
    """The [HANG] lines: one per rank (where it waits: its last collective entered), then, for
    each group whose ranks disagree, the first sequence number at which they do."""
    lines = []
    for r in records:
        where = f"[HANG] rank={r['rank']} node={r['node']} gpu={r['gpu']}"
        if r["now"] is not None or not r["entries"]:
            # past its last collective: in one the record cannot see (DDP's C++ broadcasts),
            # or not in a collective at all
            now = r["now"] or {"step": 0, "phase": "start"}
            last = _where(r["entries"][-1], "after_") if r["entries"] else "after_seq=0"
            lines.append(f"{where} waits_in=unrecorded {last} step={now['step']} "
                         f"phase={now['phase']}")
            continue
        e = r["entries"][-1]
        state = f" state={e['state']}" if "state" in e else ""
        lines.append(f"{where} waits_in={e['kind']} {_where(e)} numel={e['numel']} "
                     f"bytes={e['bytes']} step={e['step']} phase={e['phase']}{state}")
    sources = {r["source"] for r in records}
    if len(sources) > 1:  # NCCL's count includes DDP's C++ collectives, the record's does not
        dumped = ",".join(str(r["rank"]) for r in records if r["source"] == "flight recorder")
        lines.append(f"[HANG] first_disagreement seq=unknown (ranks {dumped} left NCCL's "
                     f"dumps, the others only the toolkit's record: their sequence numbers "
                     f"count different collectives)")
        return lines
    for group, seq, seen in first_disagreements(records):
        there = " ".join(f"rank{rank}={e['kind']}/{e['numel']}/{e['phase']}" if e else
                         f"rank{rank}=none" for rank, e in seen.items())
        members = "" if group == "0" else f"group={group} ranks={','.join(map(str, seen))} "
        lines.append(f"[HANG] first_disagreement {members}seq={seq} {there}")
    if not lines[len(records):]:
        lines.append("[HANG] first_disagreement seq=none (the ranks' records agree as far as "
                     "they go)")
    return lines


def report_dumps(rank: int, pid: int) -> None:
    """Worker ``pid`` (rank ``rank``) has ended; its watchdog calls this. When NCCL dumped its
    flight recorder, which it does on a collective timeout before its own watchdog aborts the
    process (no Python error, so common.run cannot report), name the hang from the dumps."""
    folder = record_dir()
    if any(folder.glob(FLIGHT_RECORDER_PREFIX + "*")):
        report(folder, dump_grace_s=2.0, owner=(rank, pid))  # a moment for the other ranks' dumps


def _recorded_by(folder: Path, rank: int, pid: int) -> bool:
    """Whether rank ``rank``'s record in ``folder`` is that of process ``pid`` (this run's),
    not one a previous attempt left in the same $RUN_DIR."""
    try:
        with open(folder / f"collectives-rank{rank}.txt") as f:
            return f"pid={pid}" in f.readline().split()
    except OSError:
        return False


def _has_fr_trace() -> bool:
    """Whether the installed torch has its flight-recorder analysis (fr_trace), found without
    importing torch: the watchdog calls report() too, and it starts without torch."""
    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin) and (
        Path(spec.origin).parent / "distributed" / "flight_recorder" / "fr_trace.py").exists()


def report(folder: Path | None = None, dump_grace_s: float = 1.0,
           owner: tuple | None = None) -> bool:
    """Print the [HANG] lines once per run, from whichever process gets here first (a rank
    whose collective timed out, or a watchdog that ends a frozen rank); the others return
    False. ``dump_grace_s``: a moment for the flight recorder's dumps, written on the same
    timeout. ``owner``: (rank, pid) of the process the report is for (default: this one),
    which must have kept a record in this run. Never raises: the run is ending anyway."""
    folder = folder or record_dir()
    rank, pid = owner or (_record and _record.rank, os.getpid())
    if rank is None or not _recorded_by(folder, rank, pid):
        return False  # no record of this run (it failed before keeping one)
    try:
        if not any(folder.glob("collectives-rank*.txt")) and \
                not any(folder.glob(FLIGHT_RECORDER_PREFIX + "*")):
            return False
        fd = os.open(folder / REPORTED, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        time.sleep(dump_grace_s)
        lines = hang_lines(read_all(folder))
    except FileExistsError:
        return False
    except Exception as err:  # noqa: BLE001 (a half-written dump or record: the run is
        # ending anyway, and the watchdog that calls this must still end its rank)
        print(f"note: could not read the collectives' record in {folder}: "
              f"{type(err).__name__}: {err}", flush=True)
        return False
    lines.append(f"[HANG] record={folder}")
    if any(folder.glob(FLIGHT_RECORDER_PREFIX + "*")) and _has_fr_trace():  # torch's analysis
        lines.append(f"[HANG] analyse: python -m torch.distributed.flight_recorder.fr_trace "
                     f"{folder} --prefix {FLIGHT_RECORDER_PREFIX} --allow-incomplete-ranks")
    print("\n".join(lines), flush=True)
    return True
