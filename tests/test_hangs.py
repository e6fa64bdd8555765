"""The hang named: when ranks issue different collectives, the run ends within --dist-timeout
with one [HANG] line per rank (its collective, step and phase) and the first sequence number
at which the ranks disagree, read from every rank's record (gloo) or from NCCL's flight
recorder dumps (a fixture in its documented format)."""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from training import hangs
from conftest import ON_CUDA, REPO, env_for_tests

RUN = ["--model", "cnn", "--synthetic-size", "64", "--batch-size", "16", "--epochs", "1",
       "--num-workers", "0", "--amp", "off", "--device", "cpu", "--dist-timeout", "4",
       "--tensorboard", "off"]


def _hang_lines(out: str) -> list:
    return [line for line in out.splitlines() if line.startswith("[HANG]")]


@pytest.mark.parametrize("patch,due", [
    # rank 1 skips the epoch's metric reduction: its next all-reduce (the epoch's times, 2
    # numbers) meets rank 0's reduction of the metrics (6 numbers). The sequence numbers
    # count every collective of the run's own group before, the loss watch's vote on a jump
    # included (the stop vote's are counted in its own group)
    ("rank1_skips_an_all_reduce",
     ["rank=0 node=", "waits_in=all_reduce seq=6 numel=6 bytes=48 step=2 phase=evaluation",
      "rank=1 node=", "waits_in=all_reduce seq=6 numel=2 bytes=16 step=2 phase=evaluation",
      "first_disagreement seq=6 rank0=all_reduce/6/evaluation rank1=all_reduce/2/evaluation"]),
    # rank 0 all-reduces inside its checkpoint write while rank 1 gathers the checkpoint's verdict
    ("rank0_saves_alone",
     ["rank=0 node=", "waits_in=all_reduce seq=10 numel=3 bytes=12 step=2 phase=checkpoint",
      "rank=1 node=", "waits_in=all_gather_object seq=10", "phase=checkpoint",
      "first_disagreement seq=10 rank0=all_reduce/3/checkpoint rank1=all_gather_object"]),
    # rank 1 ends its epoch a step early; rank 0 waits in DDP's own (C++) broadcast that opens
    # its second step, which the record names by its place: after step 1's stop vote (the
    # first collective of the vote's group), in step 2's forward
    ("rank1_one_batch_fewer",
     ["rank=0 node=",
      "waits_in=unrecorded after_group=1:stop_vote after_seq=1 step=2 phase=forward",
      "rank=1 node=", "waits_in=all_gather_object seq=2",
      "first_disagreement seq=2 rank0=none rank1=all_gather_object"]),
])
def test_hang_is_named_per_rank(tmp_path, patch, due):
    """Each mismatch ends the run non-zero within the collective timeout, with its [HANG]
    lines printed once, and leaves no process behind."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "patched_run.py"), patch, str(tmp_path), "ddp_train.py", *RUN,
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env_for_tests({"RUN_DIR": str(tmp_path)}), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        left = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == proc.pid:
                    left.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        for p in left:
            p.kill()
    assert proc.returncode != 0
    assert not left, f"processes left behind: {[p.cmdline() for p in left]}"
    lines = _hang_lines(out)
    assert len(lines) == 4, out[-3000:]  # two ranks, the disagreement, the record's folder
    text = "\n".join(lines)
    for piece in due:
        assert piece in text, text
    assert time.time() - t0 < 80


def test_a_hybrid_runs_hang_is_named_group_by_group(tmp_path):
    """fsdp_train.py --sharding hybrid on two torchrun 'nodes' of 2 ranks each, rank 1 one
    batch short: each rank's line names the group it waits in, FSDP's real collectives read
    through the record's wrapper (their group and size, passed by keyword or position)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hybrid-hang",
         str(REPO / "tests" / "patched_run.py"), "rank1_one_batch_fewer", str(tmp_path),
         "fsdp_train.py", *RUN, "--synthetic-size", "128", "--sharding", "hybrid"],
        env=env_for_tests({"RUN_DIR": str(tmp_path)}), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    out = "".join(p.communicate(timeout=120)[0] for p in procs)
    assert [p.returncode != 0 for p in procs] == [True, True], out[-3000:]
    lines = _hang_lines(out)
    assert len(lines) == 9, out[-3000:]  # 4 ranks, 4 groups that disagree, the record's folder
    # rank 1 went on to the epoch's end (its metrics: the run's own group, seq 1); rank 0
    # waits for it in their node's gather, the other node's ranks for ranks 0 and 1 in the
    # replicate groups' all-reduce of the gradients
    assert " waits_in=all_gather_object seq=1 " in lines[1], lines
    assert re.search(r"rank=0 .* waits_in=\w*all_gather\w* group=1:shard seq=\d+ .*"
                     r"phase=forward$", lines[0]), lines
    for rank, group in ((2, "3:replicate"), (3, "4:replicate")):
        assert re.search(rf"rank={rank} .* waits_in=all_reduce group={group} seq=\d+ .*"
                         r"phase=backward$", lines[rank]), lines
    assert lines[5].startswith("[HANG] first_disagreement group=1:shard ranks=0,1 seq="), lines
    assert lines[5].endswith(" rank1=none"), lines


def _dump(path, entries, groups=None):
    """A flight-recorder dump in torch's documented format (version 2.x: a pickled dict of
    "version", "pg_config", "pg_status", "entries"). ``groups``: {name: ranks}, the rank's
    process groups (default: the run's own, of 2 ranks), described as in DESCS."""
    groups = groups or {"0": [0, 1]}
    config = {name: {"name": name, "desc": DESCS.get(name, "undefined"), "ranks": str(ranks)}
              for name, ranks in groups.items()}
    with open(path, "wb") as f:
        pickle.dump({"version": "2.10", "pg_config": config, "pg_status": {},
                     "entries": entries}, f)


#: The groups' descriptions in the dumps: fsdp_train.py's --sharding hybrid on 2 nodes x 2 GPUs
DESCS = {"0": "default_pg", "1": "shard", "2": "shard", "3": "replicate", "4": "replicate"}


def _entry(seq, name, sizes, state, dtype="Float", group="0", record_id=None):
    return {"record_id": seq - 1 if record_id is None else record_id, "pg_id": int(group),
            "process_group": (group, DESCS.get(group, "undefined")),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"nccl:{name}", "time_created_ns": seq, "input_sizes": sizes,
            "input_dtypes": [dtype] * len(sizes), "output_sizes": sizes,
            "output_dtypes": [dtype] * len(sizes), "state": state, "retired": False,
            "timeout_ms": 600000, "is_p2p": False, "frames": []}


def _two_dumps(folder):
    """Rank 0 waits in the gradient all-reduce, rank 1 in a broadcast of its own (a
    rank-0-only save seen from the other side): they disagree at collective 3."""
    folder.mkdir(exist_ok=True)
    done = [_entry(1, "broadcast", [[10]], "completed"), _entry(2, "all_reduce", [[4, 5]],
                                                                  "completed")]
    _dump(folder / "nccl_trace_rank_0", done + [_entry(3, "all_reduce", [[1000, 2]],
                                                         "started")])
    _dump(folder / "nccl_trace_rank_1", done + [_entry(3, "broadcast", [[7]], "scheduled",
                                                         "Long"),
                                                  _entry(4, "all_reduce", [[1]], "scheduled")])
    (folder / "collectives-rank1.txt").write_text("rank=1 node=n02 gpu=cuda:1 pid=1\n")


def test_flight_recorder_dumps_name_the_hang(tmp_path):
    """NCCL's dumps and a rank's own record (its node and GPU) are read by the same code."""
    _two_dumps(tmp_path)
    lines = hangs.hang_lines(hangs.read_all(tmp_path))
    assert lines[0] == ("[HANG] rank=0 node=? gpu=? waits_in=all_reduce seq=3 numel=2000 "
                        "bytes=8000 step=- phase=- state=started")
    assert lines[1] == ("[HANG] rank=1 node=n02 gpu=cuda:1 waits_in=broadcast seq=3 numel=7 "
                        "bytes=56 step=- phase=- state=scheduled")
    assert lines[2].startswith("[HANG] first_disagreement seq=3 rank0=all_reduce/2000/- "
                               "rank1=broadcast/7/-")


def test_a_hang_in_a_subgroup_is_named_with_its_group(tmp_path):
    """--sharding hybrid on 2 nodes x 2 GPUs: FSDP's collectives run on the shard groups
    ("1": ranks 0,1; "2": ranks 2,3) and the replicate groups ("3": 0,2; "4": 1,3), each
    counting from 1. Rank 3 went to an all-reduce of the run's own group while rank 2 waits
    for it in their shard group's all-gather, and ranks 0 and 1 wait for ranks 2 and 3 in the
    replicate groups' all-reduce: each rank's line names the group it waits in, and each group
    whose members disagree has its own first_disagreement line. Groups are named by torch's
    number and the description fsdp_train.py gives them."""
    start = _entry(1, "broadcast", [[10]], "completed", record_id=0)
    groups = {0: {"0": [0, 1, 2, 3], "1": [0, 1], "3": [0, 2]},
              1: {"0": [0, 1, 2, 3], "1": [0, 1], "4": [1, 3]},
              2: {"0": [0, 1, 2, 3], "2": [2, 3], "3": [0, 2]},
              3: {"0": [0, 1, 2, 3], "2": [2, 3], "4": [1, 3]}}
    shard_done = [_entry(1, "_all_gather_base", [[100]], "completed", group="1", record_id=1),
                  _entry(2, "_reduce_scatter_base", [[200]], "completed", group="1",
                         record_id=2)]
    entries = {0: shard_done + [_entry(1, "all_reduce", [[50]], "started", group="3",
                                       record_id=3)],
               1: shard_done + [_entry(1, "all_reduce", [[50]], "started", group="4",
                                       record_id=3)],
               2: [_entry(1, "_all_gather_base", [[100]], "started", group="2", record_id=1),
                   _entry(2, "_reduce_scatter_base", [[200]], "scheduled", group="2",
                          record_id=2)],
               3: [_entry(2, "all_reduce", [[3]], "started", record_id=1)]}
    for rank in range(4):
        _dump(tmp_path / f"nccl_trace_rank_{rank}", [start] + entries[rank], groups[rank])
    lines = hangs.hang_lines(hangs.read_all(tmp_path))
    assert lines == [
        "[HANG] rank=0 node=? gpu=? waits_in=all_reduce group=3:replicate seq=1 numel=50 bytes=200 "
        "step=- phase=- state=started",
        "[HANG] rank=1 node=? gpu=? waits_in=all_reduce group=4:replicate seq=1 numel=50 bytes=200 "
        "step=- phase=- state=started",
        "[HANG] rank=2 node=? gpu=? waits_in=_all_gather_base group=2:shard seq=1 numel=100 "
        "bytes=400 step=- phase=- state=started",
        "[HANG] rank=3 node=? gpu=? waits_in=all_reduce seq=2 numel=3 bytes=12 step=- phase=- "
        "state=started",
        "[HANG] first_disagreement seq=2 rank0=none rank1=none rank2=none "
        "rank3=all_reduce/3/-",
        "[HANG] first_disagreement group=2:shard ranks=2,3 seq=1 rank2=_all_gather_base/100/- "
        "rank3=none",
        "[HANG] first_disagreement group=3:replicate ranks=0,2 seq=1 rank0=all_reduce/50/- "
        "rank2=none",
        "[HANG] first_disagreement group=4:replicate ranks=1,3 seq=1 rank1=all_reduce/50/- "
        "rank3=none"]
    # a rank past its last collective, last in a subgroup
    _dump(tmp_path / "nccl_trace_rank_0", [start] + shard_done, groups[0])
    assert hangs.hang_lines(hangs.read_all(tmp_path))[0] == (
        "[HANG] rank=0 node=? gpu=? waits_in=unrecorded after_group=1:shard after_seq=2 step=- "
        "phase=-")


def test_the_record_counts_each_group_on_its_own(tmp_path, monkeypatch):
    """The toolkit's record (gloo) names a collective's group from its group argument,
    positional or keyword, as the flight recorder does (number:description; nothing for the
    run's own), and counts each group's collectives from 1."""
    class Group:
        def __init__(self, name, desc):
            self.group_name, self.group_desc = name, desc

    class Dist:  # torch.distributed's signatures, for the wrapper to read
        @staticmethod
        def all_reduce(tensor, op=None, group=None, async_op=False):
            pass

        @staticmethod
        def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
            pass

    monkeypatch.setattr(hangs, "_record", hangs.Record(tmp_path, 0, "cpu"))
    all_reduce = hangs._wrapped(Dist, "all_reduce", 0)
    reduce_scatter = hangs._wrapped(Dist, "reduce_scatter_tensor", 1)
    shard, vote = Group("1", "shard"), Group("2", "stop_vote")
    x = torch.zeros(4)
    all_reduce(x)  # the run's own group, "0"
    reduce_scatter(x[:2], x, None, shard, True)  # positional group, async: no "done"
    reduce_scatter(output=x[:2], input=x, group=shard, async_op=True)
    all_reduce(x, group=vote)
    all_reduce(x, None, Group("0", "default_pg"))
    record = hangs.read_record(tmp_path / "collectives-rank0.txt")
    assert [(e["group"], e["seq"], e["kind"], e["numel"], e["done"])
            for e in record["entries"]] == [
        ("0", 1, "all_reduce", 4, True), ("1:shard", 1, "reduce_scatter_tensor", 4, False),
        ("1:shard", 2, "reduce_scatter_tensor", 4, False), ("2:stop_vote", 1, "all_reduce", 4,
                                                            True),
        ("0", 2, "all_reduce", 4, True)]
    assert record["groups"] == {"0", "1:shard", "2:stop_vote"}


def test_the_record_names_each_phase_of_a_step(tmp_path, monkeypatch):
    """The hooks watch() installs name the phases of a step as they start: forward, backward
    (where FSDP's collectives of the backward run; DDP's buckets name themselves after it),
    optimizer; and evaluation in eval mode."""
    monkeypatch.setattr(hangs, "COLLECTIVES", {})  # torch.distributed stays as it is
    monkeypatch.setattr(hangs, "_record", None)
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hangs.watch(model, optimizer, "cpu")
    for _ in range(2):
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
    with torch.no_grad():
        model.eval()(torch.ones(4, 3))
    lines = (tmp_path / "collectives" / "collectives-rank0.txt").read_text().splitlines()[1:]
    assert lines == ["- 1 forward", "- 1 backward", "- 1 optimizer", "- 2 forward",
                     "- 2 backward", "- 2 optimizer", "- 2 evaluation"]


def _watch_silent(worker: subprocess.Popen, tmp_path) -> subprocess.CompletedProcess:
    """What rank 1's watchdog printed, its worker ``worker`` silent (a pipe that never beats)
    past a 1 s timeout, once the worker has ended (its returncode is then set)."""
    read_end, write_end = os.pipe()
    try:
        watchdog = subprocess.run(
            [sys.executable, "-m", "training.watchdog", str(worker.pid), "0", "1", "1"],
            stdin=read_end, capture_output=True, text=True, timeout=30, cwd=REPO,
            env=env_for_tests({"RUN_DIR": str(tmp_path)}))
        worker.wait(timeout=10)
    finally:
        os.close(read_end)
        os.close(write_end)
        worker.kill()
    return watchdog


def _catching_stacks(body: str) -> subprocess.Popen:
    """A Python process that installed print_stacks_on_signal and said "ready", then runs
    ``body`` from its line 6 on; stdout and stderr piped."""
    worker = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from training import hangs\n"
        "hangs.print_stacks_on_signal()\n"
        "print('ready', flush=True)\n" + body)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "ready\n"
    return worker


def test_watchdog_names_the_hang_of_a_frozen_rank(tmp_path):
    """The watchdog that ends a rank silent past its time prints the [HANG] lines first (here
    the 'worker' is a sleeping process that never beats, with records two ranks left)."""
    folder = tmp_path / "collectives"
    folder.mkdir()
    worker = subprocess.Popen(["sleep", "60"])
    (folder / "collectives-rank0.txt").write_text(
        "rank=0 node=n01 gpu=cuda:0 pid=1\n1 all_reduce 10 40 1 backward.bucket0\n")
    (folder / "collectives-rank1.txt").write_text(
        f"rank=1 node=n01 gpu=cuda:1 pid={worker.pid}\n- 1 forward\n")
    watchdog = _watch_silent(worker, tmp_path)
    assert worker.returncode == -9  # the watchdog ended it
    lines = _hang_lines(watchdog.stdout)
    assert lines[:3] == [
        "[HANG] rank=0 node=n01 gpu=cuda:0 waits_in=all_reduce seq=1 numel=10 bytes=40 step=1 "
        "phase=backward.bucket0",
        "[HANG] rank=1 node=n01 gpu=cuda:1 waits_in=unrecorded after_seq=0 step=1 phase=forward",
        "[HANG] first_disagreement seq=1 rank0=all_reduce/10/backward.bucket0 rank1=none"], \
        watchdog.stdout + watchdog.stderr
    assert "no sign of life for 1 s" in watchdog.stderr


def test_a_real_flight_recorder_dump_is_read():
    """A dump that NCCL wrote on an H200 (torch 2.11, one rank: an all-reduce of 1000 x 3
    floats, a broadcast of 7 int64, an all-gather of 4 bf16, all completed)."""
    [record] = hangs.read_all(REPO / "tests" / "fixtures" / "flight_recorder")
    assert [(e["seq"], e["kind"], e["numel"], e["bytes"], e["state"])
            for e in record["entries"]] == [(1, "all_reduce", 3000, 12000, "completed"),
                                            (2, "broadcast", 7, 56, "completed"),
                                            (3, "_all_gather_base", 4, 8, "completed")]
    assert hangs.hang_lines([record]) == [
        "[HANG] rank=0 node=? gpu=? waits_in=unrecorded after_seq=3 step=- phase=-",
        "[HANG] first_disagreement seq=none (the ranks' records agree as far as they go)"]


def test_watchdog_names_the_hang_after_nccl_aborted_its_worker(tmp_path):
    """NCCL aborts a rank whose collective timed out (no Python error reaches common.run), after
    dumping its flight recorder: the rank's watchdog, seeing it gone, names the hang."""
    _two_dumps(tmp_path / "collectives")
    worker = subprocess.Popen(["sleep", "0.5"])
    (tmp_path / "collectives" / "collectives-rank0.txt").write_text(
        f"rank=0 node=n01 gpu=cuda:0 pid={worker.pid}\n")
    watchdog = subprocess.run(
        [sys.executable, "-m", "training.watchdog", str(worker.pid), "0", "30", "0"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, cwd=REPO,
        env=env_for_tests({"RUN_DIR": str(tmp_path)}))
    worker.wait()
    lines = _hang_lines(watchdog.stdout)
    assert lines[0].startswith("[HANG] rank=0 node=n01 gpu=cuda:0 waits_in=all_reduce seq=3 ")
    assert lines[2].startswith("[HANG] first_disagreement seq=3 rank0=all_reduce/2000/-"), \
        watchdog.stdout + watchdog.stderr
    record = f"[HANG] record={tmp_path / 'collectives'}"
    analyse = (f"[HANG] analyse: python -m torch.distributed.flight_recorder.fr_trace "
               f"{tmp_path / 'collectives'} --prefix nccl_trace_rank_ --allow-incomplete-ranks")
    # torch's analysis is named where this torch has it (not 2.9)
    assert lines[-2:] == ([record, analyse] if hangs._has_fr_trace() else [lines[-2], record])


@pytest.mark.cuda_ok
@pytest.mark.skipif(not ON_CUDA, reason="NCCL's flight recorder needs a GPU (DPT_TEST_DEVICE=cuda)")
def test_flight_recorder_dump_on_request_is_read_back(tmp_path, monkeypatch):
    """On NCCL with one rank: the flight recorder, turned on as the scripts turn it on, keeps
    the collectives; its dump, asked for by hand, is read by the code that names a hang."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_nccl_trace
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    hangs.flight_recorder_env()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        x = torch.ones(1000, 3, device="cuda")
        dist.all_reduce(x)
        dist.broadcast(torch.ones(7, dtype=torch.int64, device="cuda"), src=0)
        torch.cuda.synchronize()
        dump = _dump_nccl_trace(includeStackTraces=False)
    finally:
        dist.destroy_process_group()
    folder = tmp_path / "collectives"
    (folder / "nccl_trace_rank_0").write_bytes(dump)
    [record] = hangs.read_all(folder)
    kinds = [(e["kind"], e["numel"], e["bytes"]) for e in record["entries"]]
    assert ("all_reduce", 3000, 12000) in kinds and ("broadcast", 7, 56) in kinds, kinds
    assert hangs.hang_lines([record])[0].startswith("[HANG] rank=0 "), kinds


def test_a_previous_attempts_record_is_not_reported(tmp_path, capsys):
    """A requeued run that fails before it keeps a record of its own (in the same $RUN_DIR)
    names no hang from the records its previous attempt left."""
    (tmp_path / "collectives-rank0.txt").write_text(
        "rank=0 node=n01 gpu=cuda:0 pid=1\n1 all_reduce 10 40 1 backward.bucket0\n")
    assert not hangs.report(tmp_path, dump_grace_s=0)
    assert not hangs.report(tmp_path, dump_grace_s=0, owner=(0, 2))
    assert hangs.report(tmp_path, dump_grace_s=0, owner=(0, 1))
    assert "[HANG] rank=0 node=n01 gpu=cuda:0 waits_in=all_reduce seq=1" in capsys.readouterr().out


def test_a_half_written_dump_is_one_note_not_an_exception(tmp_path, capsys):
    """A dump cut short (NCCL still writing it, the node dying) must not raise out of
    report(): the watchdog that calls it must still end its frozen rank."""
    (tmp_path / "collectives-rank0.txt").write_text(
        "rank=0 node=n01 gpu=cuda:0 pid=1\n1 all_reduce 10 40 1 backward.bucket0\n")
    _dump(tmp_path / "nccl_trace_rank_1", [_entry(1, "all_reduce", [[10]], "started")])
    data = (tmp_path / "nccl_trace_rank_1").read_bytes()
    (tmp_path / "nccl_trace_rank_1").write_bytes(data[:len(data) // 2])
    assert not hangs.report(tmp_path, dump_grace_s=0, owner=(0, 1))
    assert "note: could not read the collectives' record" in capsys.readouterr().out


def test_dumps_and_records_are_not_compared_seq_by_seq(tmp_path):
    """NCCL's sequence numbers count DDP's C++ collectives too, the toolkit's record does not:
    a rank with a dump beside a rank with only the record (killed before NCCL dumped) gives
    no made-up disagreement."""
    _dump(tmp_path / "nccl_trace_rank_0", [_entry(1, "all_reduce", [[6]], "started")])
    (tmp_path / "collectives-rank1.txt").write_text(
        "rank=1 node=n02 gpu=cuda:1 pid=1\n1 all_reduce 6 24 1 backward.bucket0\n")
    lines = hangs.hang_lines(hangs.read_all(tmp_path))
    assert lines[1] == ("[HANG] rank=1 node=n02 gpu=cuda:1 waits_in=all_reduce seq=1 numel=6 "
                        "bytes=24 step=1 phase=backward.bucket0")
    assert lines[2].startswith("[HANG] first_disagreement seq=unknown (ranks 0 left NCCL's")


def test_a_clean_end_leaves_no_record(tmp_path, monkeypatch):
    """Past the last barrier there is no hang to name: the rank's record goes, and the folder
    with the last one (without the launchers it sits in the temporary directory)."""
    monkeypatch.setenv("RUN_DIR", str(tmp_path))  # where the ranks keep their records
    folder = tmp_path / "collectives"
    assert hangs.record_dir() == folder
    records = [hangs.Record(folder, rank, "cpu") for rank in (0, 1)]
    for record in records:
        record.enter("all_reduce", 6, 24)
    for record in records:
        monkeypatch.setattr(hangs, "_record", record)
        assert record.path.exists()
        hangs.forget()
        assert not record.path.exists() and hangs._record is None
    assert not folder.exists()
    hangs.forget()  # nothing kept (one process): nothing to do


def test_watchdog_has_a_hung_rank_print_its_python_stacks_before_ending_it(tmp_path):
    """A rank silent past its time but not stopped: the watchdog has it print where its Python
    code sits (its own stderr, the job's log), then ends it; the dump alone does not end it
    (SIGKILL, -9, not the signal's default action)."""
    worker = _catching_stacks("def stuck_in_user_code():\n"
                              "    time.sleep(60)\n"
                              "stuck_in_user_code()\n")
    watchdog = _watch_silent(worker, tmp_path)
    stacks = worker.stderr.read()
    assert worker.returncode == -9
    assert re.search(r'line 7 in stuck_in_user_code\n.*line 8 in <module>', stacks), stacks
    assert "no sign of life for 1 s (hung; its Python stacks are in its output above)" in \
        watchdog.stderr, watchdog.stderr


def test_the_stacks_signal_goes_only_to_processes_that_catch_it():
    """SIGUSR2 ends a process without a handler (torchrun, a shell, a logger): ask_for_stacks
    skips those and signals a process that installed print_stacks_on_signal, which goes on."""
    plain = subprocess.Popen(["sleep", "60"])
    try:
        caught = _catching_stacks("time.sleep(60)\n")
        try:
            assert not hangs.catches_stacks_signal(plain.pid)
            assert hangs.catches_stacks_signal(caught.pid)
            assert hangs.ask_for_stacks([plain.pid, caught.pid], wait_s=0.5) == [caught.pid]
            assert plain.poll() is None and caught.poll() is None  # both still run
        finally:
            caught.kill()
    finally:
        plain.kill()
    assert "(most recent call first)" in caught.communicate(timeout=10)[1]
