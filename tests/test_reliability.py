"""Faults found by trying to break the toolkit (CPU, gloo): checkpoints that must replace each
other, a damaged DCP shard, two runs in one checkpoint dir, orphaned and frozen workers, a peer
lost on another node, a rank's own data error, stop signals that only some ranks receive.

Two "nodes" are two torchrun processes on this machine that meet at a c10d rendezvous, as on a
cluster (--nnodes 2 --nproc-per-node 1 each)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import torch
import pytest


from training import checkpoint, contract, devices, faults, tinyimagenet
from conftest import REPO, check_ok, env_for_tests, metrics, read_until, run_script, wait_for

RUN = ["--model", "cnn", "--synthetic-size", "320", "--batch-size", "16", "--epochs", "2",
       "--num-workers", "0", "--amp", "off", "--seed", "7", "--lr", "0.02"]
LONG = RUN[:RUN.index("--epochs")] + ["--epochs", "60"] + RUN[RUN.index("--epochs") + 2:]


def _start(cmd, **kw):
    return subprocess.Popen(cmd, env=env_for_tests(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def _torchrun(script, args, nproc=2, nodes=None):
    """torchrun on one machine; with ``nodes`` = (port, ) one node of a 2-node rendezvous."""
    if nodes is None:
        launch = ["--standalone", f"--nproc-per-node={nproc}"]
    else:
        launch = ["--nnodes=2", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{nodes}", "--rdzv-id=reliability"]
    return [sys.executable, "-m", "torch.distributed.run", *launch, str(REPO / script), *args]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workers(proc):
    """The training workers that a torchrun process started (python ... *_train.py)."""
    try:
        kids = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if any(a.endswith("_train.py") for a in k.cmdline())]


def _cleanup(*pids):
    """Never leave a stopped or orphaned process behind, whatever the test did."""
    for pid in pids:
        try:
            p = psutil.Process(pid)
            for q in p.children(recursive=True) + [p]:
                q.send_signal(signal.SIGCONT)
                q.kill()
        except psutil.NoSuchProcess:
            pass


def _two_nodes(args, script="ddp_train.py"):
    """Start node A and node B; return both once each has its worker and training has begun."""
    port = _free_port()
    a = _start(_torchrun(script, args, 1, nodes=port))
    b = _start(_torchrun(script, args, 1, nodes=port))
    head = read_until(a, "Epoch [1/")  # rank 0 prints: every rank is training
    assert wait_for(lambda: _workers(b), 60)
    return a, b, head


# ---- 1, 2. FSDP checkpoints replace each other; a damaged shard falls back ------------------

def test_replace_checkpoint_and_tidy_after_a_crash(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    old = ck / checkpoint.checkpoint_name(1, 0)
    old.mkdir()
    (old / "a.distcp").write_text("old")
    new = ck / ".tmp-new"
    new.mkdir()
    (new / "a.distcp").write_text("new")
    checkpoint.replace_checkpoint(new, old)  # a folder over a non-empty folder
    assert (old / "a.distcp").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in ck.iterdir()) == [old.name]
    tmp_file = ck / ".tmp-file"
    tmp_file.write_text("file")
    checkpoint.replace_checkpoint(tmp_file, old)  # a file over a folder (strategy switched)
    assert old.is_file() and old.read_text() == "file"
    # a crash between the two renames leaves .old-<name> alone: tidy puts it back
    os.replace(old, ck / f".old-{old.name}")
    (ck / ".tmp-ckpt-e0002-s0000000").mkdir()  # an interrupted save's folder
    (ck / ".tmp-x.pt-123").write_text("half")
    checkpoint.tidy_checkpoint_dir(ck)
    assert sorted(p.name for p in ck.iterdir()) == [old.name]
    assert old.read_text() == "file"
    # both there: the crash came after the new one was in place
    (ck / f".old-{old.name}").write_text("older")
    checkpoint.tidy_checkpoint_dir(ck)
    assert sorted(p.name for p in ck.iterdir()) == [old.name] and old.read_text() == "file"


def test_fsdp_saves_over_its_checkpoints_and_falls_back_past_a_truncated_shard(tmp_path):
    """Before: `--resume never` into a dir with checkpoints, and a run that fell back past a
    damaged newest checkpoint, both crashed at their next save (Directory not empty) and left a
    .tmp- folder; a truncated .distcp gave a CheckpointException traceback (BaseException)."""
    ck = tmp_path / "ck"
    # 2 steps an epoch: four 2-process runs, each about its checkpoints, not its training
    args = RUN + ["--synthetic-size", "64", "--checkpoint-dir", str(ck)]
    check_ok(run_script("fsdp_train.py", args, nproc=2))
    newest, previous = checkpoint.list_checkpoints(ck)
    again = run_script("fsdp_train.py", args + ["--resume", "never"], nproc=2)
    check_ok(again)
    assert [p.name for p in checkpoint.list_checkpoints(ck)] == [newest.name, previous.name]
    assert not [p for p in ck.iterdir() if p.name.startswith((".tmp-", ".old-"))]

    shard = sorted(newest.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])  # cut in half
    cut = shard.stat().st_size
    resumed = run_script("fsdp_train.py", args, nproc=2)
    check_ok(resumed)
    out = resumed.stdout + resumed.stderr
    assert out.count(f"warning: checkpoint {newest} is unusable") == 1, out[-3000:]
    # named, not "CheckpointException ranks:dict_keys([1])" (or a hint of another --model)
    assert (f"truncated or damaged: incomplete shard files ({shard.name}: "
            f"{cut:,} of its ") in out, out[-3000:]
    assert f"Resumed from epoch 2, step 0 ({previous})" in resumed.stdout
    assert "Traceback" not in out
    assert metrics(resumed.stdout)[-1]["epoch"] == "2"
    # the damaged checkpoint was replaced by a good one: it loads now
    done = run_script("fsdp_train.py", args, nproc=2)
    check_ok(done)
    assert f"Resumed from epoch 3, step 0 ({newest})" in done.stdout
    assert "unusable" not in done.stdout

    # 64 bytes changed inside a shard, its length the same: loaded as weights before (DCP keeps
    # no checksum). Rank 1 checks __0_0.distcp (each rank reads every world-th file), and both
    # ranks set the checkpoint aside, together.
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    flipped = run_script("fsdp_train.py", args, nproc=2)
    check_ok(flipped)
    out = flipped.stdout + flipped.stderr
    assert (f"warning: checkpoint {newest} is unusable (rank 0, 1: damaged: the bytes of its "
            f"__0_0.distcp fail their checksum (changed on the disk or in a copy)); trying the "
            f"previous one") in out, out[-3000:]
    assert f"Resumed from epoch 2, step 0 ({previous})" in flipped.stdout
    assert "Traceback" not in out

    # rank 1 alone cannot read meta.pt: its failure went to the vote while rank 0 was in the
    # shards' check, the two gathers met, and the run ended on a ValueError traceback
    unread = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "patched_run.py"), "meta_pt_unreadable_on_rank1", str(tmp_path),
         "fsdp_train.py", *args], capture_output=True, text=True, timeout=300,
        env=env_for_tests(), cwd=REPO)
    out = unread.stdout + unread.stderr
    assert unread.returncode != 0 and "ValueError" not in out, out[-3000:]
    # every rank sets it aside (rank 0, 1), the rank that could not read it named
    assert out.count(f"warning: checkpoint {newest} is unusable (rank 0, 1: unreadable: its "
                     f"meta.pt (Input/output error, on rank 1)); trying the previous "
                     f"one") == 1, out[-3000:]
    assert (f"error: none of the 2 checkpoints in {ck} could be loaded (why is above)"
            in unread.stderr), out[-3000:]


# ---- 3. one run per checkpoint dir; workers end with their launcher ------------------------

def test_second_run_into_a_held_checkpoint_dir_stops_naming_the_holder(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (ck / faults.LOCK_FILE).write_text(f"{socket.gethostname()} {holder.pid}\n")
        proc = run_script("ddp_train.py", RUN + ["--checkpoint-dir", str(ck)], nproc=2)
        assert proc.returncode != 0
        assert proc.stderr.count("is in use by another run") == 1, proc.stderr[-3000:]
        assert f"(host {socket.gethostname()}, pid {holder.pid})" in proc.stderr
        assert 'ddp_train.py", line' not in proc.stderr  # no traceback of a worker
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone now: its lock is stale and taken over
    proc = run_script("ddp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck)])
    check_ok(proc)
    assert f"taking over the lock of {ck} from a run that is gone" in proc.stdout
    assert not (ck / faults.LOCK_FILE).exists()  # released at the end
    proc = run_script("dp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck),
                                            "--resume", "never"])
    check_ok(proc)
    assert "taking over" not in proc.stdout and not (ck / faults.LOCK_FILE).exists()


def test_workers_end_when_torchrun_is_killed_and_a_rerun_resumes(tmp_path):
    """Before: SIGKILL to torchrun left both workers training on as orphans (torchrun starts
    them in their own session), writing checkpoints a rerun then resumed from."""
    ck = tmp_path / "ck"
    args = LONG + ["--checkpoint-dir", str(ck)]
    proc = _start(_torchrun("ddp_train.py", args))
    try:
        read_until(proc, "Epoch [1/")
        workers = _workers(proc)
        assert len(workers) == 2
        proc.kill()  # torchrun alone
        proc.wait()
        t0 = time.time()
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"orphaned workers still running: {alive}"
        print(f"workers ended {time.time() - t0:.1f} s after torchrun was killed")
    finally:
        _cleanup(proc.pid, *[w.pid for w in _workers(proc)])
    newest = checkpoint.list_checkpoints(ck)[0]  # the end of epoch e is ckpt-e<e>-s0
    epochs = int(re.match(checkpoint.CHECKPOINT_RE, newest.name).group(1)) + 1
    rerun = run_script("ddp_train.py", RUN[:RUN.index("--epochs")] + ["--epochs", str(epochs)]
                       + RUN[RUN.index("--epochs") + 2:] + ["--checkpoint-dir", str(ck)],
                       nproc=2)
    check_ok(rerun)
    assert f"Resumed from epoch {epochs}, step 0 ({newest})" in rerun.stdout


# ---- 4, 5. a peer lost or frozen on another node --------------------------------------------

def test_peer_lost_on_another_node_is_one_line(tmp_path):
    """Before: the surviving rank printed a 50-line gloo traceback (RuntimeError, not
    DistError) instead of the one-line collective failure."""
    a, b, _ = _two_nodes(LONG + ["--dist-timeout", "60"])
    try:
        for w in _workers(b):
            w.kill()
        b.kill()
        t0 = time.time()
        out, _ = a.communicate(timeout=120)
        assert a.returncode != 0
        assert time.time() - t0 < 60
        assert "rank 0: a collective with the other ranks failed or timed out" in out, out[-3000:]
        assert 'ddp_train.py", line' not in out, out[-3000:]  # no traceback of the worker
    finally:
        _cleanup(a.pid, b.pid)


def test_frozen_rank_on_another_node_ends_the_job_on_every_node():
    """Before: with one worker frozen by SIGSTOP, node A gave up after --dist-timeout, and
    node B's torchrun waited on its frozen worker: forever in the reported case; here 51 s for
    a timeout of 20, when B noticed the rendezvous store had gone with A and gave the frozen
    worker torchrun's 30 s grace before SIGKILL."""
    timeout = 10  # the old way takes it plus 30 s; the sign of life comes every second
    a, b, _ = _two_nodes(LONG + ["--dist-timeout", str(timeout)])
    frozen = _workers(b)[0]
    try:
        frozen.send_signal(signal.SIGSTOP)
        t0 = time.time()
        out_a, _ = a.communicate(timeout=timeout + 60)
        out_b, _ = b.communicate(timeout=timeout + 60)
        took = time.time() - t0
        assert a.returncode != 0 and b.returncode != 0
        assert took < timeout + 25, f"ended after {took:.1f} s"
        print(f"ended {took:.1f} s after the SIGSTOP")
        assert not frozen.is_running() or frozen.status() == psutil.STATUS_ZOMBIE
        assert f"no sign of life for {timeout} s (stopped)" in out_b, out_b[-3000:]
    except subprocess.TimeoutExpired:
        pytest.fail("a node did not end within --dist-timeout + 60 s of a rank freezing")
    finally:
        _cleanup(a.pid, b.pid, frozen.pid)


def test_frozen_rank_on_one_node_ends_within_the_timeout():
    """Before: --dist-timeout plus torchrun's 30 s grace for the frozen worker (51.9 s for a
    timeout of 20 here; 62.6 s for 30 in the report)."""
    timeout = 10  # the old way takes it plus 30 s; the sign of life comes every second
    proc = _start(_torchrun("ddp_train.py", LONG + ["--dist-timeout", str(timeout)]))
    try:
        read_until(proc, "Epoch [1/")
        frozen = max(_workers(proc), key=lambda p: p.pid)
        frozen.send_signal(signal.SIGSTOP)
        t0 = time.time()
        out, _ = proc.communicate(timeout=3 * timeout)
        took = time.time() - t0
        assert proc.returncode != 0
        assert took < 1.5 * timeout + 5, f"ended after {took:.1f} s"
        print(f"ended {took:.1f} s after the SIGSTOP")
    finally:
        _cleanup(proc.pid)


# ---- 6. a rank's own data error reaches the user --------------------------------------------

def test_strict_error_on_rank_1_names_the_file(tiny_imagenet, tmp_path):
    """Before: only local rank 0 printed usage errors; rank 1's unreadable file was never
    named, and the user saw rank 0's 'Connection closed by peer' traceback."""
    from torch.utils.data import DistributedSampler
    root, _ = tiny_imagenet
    bad = tmp_path / "tin"
    shutil.copytree(root, bad)
    _, train, _ = tinyimagenet.scan_tinyimagenet(bad)
    sampler = DistributedSampler(train, num_replicas=2, rank=1, shuffle=True, seed=0,
                                 drop_last=True)
    sampler.set_epoch(0)
    victim = train[next(iter(sampler))][0]  # the first image rank 1 reads
    with open(victim, "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not really a jpeg")
    proc = run_script("ddp_train.py", ["--data-dir", str(bad), "--model", "resnet18",
                                       "--epochs", "1", "--batch-size", "8", "--strict",
                                       "--num-workers", "0", "--seed", "0"], nproc=2)
    assert proc.returncode != 0
    assert f"error: rank 1: unreadable image {victim}" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("unreadable image") == 1
    assert 'ddp_train.py", line' not in proc.stderr


# ---- 10, 11. mixed precision on a CPU; stop signals named ----------------------------------

def test_amp_on_cpu_warns_once():
    proc = run_script("ddp_train.py", RUN[:RUN.index("--amp")] + ["--amp", "bf16", "--epochs",
                                                                   "1"], nproc=2)
    check_ok(proc)
    assert proc.stderr.count("--amp bf16 on a CPU") == 1
    assert devices.cpu_amp_note("bf16", devices.cpu_flags()) in proc.stderr
    quiet = run_script("ddp_train.py", RUN + ["--epochs", "1"])
    assert "on a CPU" not in quiet.stderr


@pytest.mark.parametrize("amp, cpu, says", [
    ("bf16", {"avx2", "avx512_bf16", "amx_bf16"}, "note: --amp bf16 on a CPU with amx_bf16 "
                                                  "and avx512_bf16: its bf16 kernels can be "
                                                  "faster than fp32"),
    ("bf16", {"avx2"}, "warning: --amp bf16 on a CPU without bf16 instructions"),
    ("fp16", {"avx2", "amx_bf16"}, "warning: --amp fp16 on a CPU trains many times slower"),
])
def test_the_amp_note_on_a_cpu_says_what_is_true_for_that_cpu(amp, cpu, says):
    """It said bf16 trains many times slower; on a CPU with AVX512-BF16 it ran 1.5x faster."""
    assert devices.cpu_amp_note(amp, cpu).startswith(says)


def test_stop_signal_on_rank_1_only_is_named_by_rank_0(tmp_path):
    ck = tmp_path / "ck"
    proc = _start(_torchrun("ddp_train.py", LONG + ["--checkpoint-dir", str(ck)]))
    try:
        head = read_until(proc, "Epoch [1/")
        rank1 = [w for w in _workers(proc) if w.environ().get("RANK") == "1"][0]
        rank1.send_signal(signal.SIGUSR1)
        rest, _ = proc.communicate(timeout=120)
    finally:
        _cleanup(proc.pid)
    out = head + rest
    assert "SIGUSR1: checkpoint saved at epoch" in out, out[-3000:]
    assert f"exiting with code {contract.REQUEUE_EXIT} to be requeued" in out
    # the machine line launch/job.sh reads to requeue the job
    assert re.search(r"^\[STOP\] signal=SIGUSR1 epoch=\d+ step=\d+ saved=1 exit_code=75$", out,
                     re.M), out[-3000:]


def test_sigterm_to_every_process_with_loader_workers_checkpoints(tmp_path):
    """Slurm's preemption SIGTERM reaches every process of the job, the DataLoader workers
    too. Found by an adversarial try: the workers died of it (torch installs its own SIGTERM
    handler in them), and every rank failed with a traceback instead of checkpointing."""
    ck = tmp_path / "ck"
    args = [a if a != "0" else "1" for a in LONG]  # --num-workers 1
    assert args[args.index("--num-workers") + 1] == "1"
    proc = _start(_torchrun("ddp_train.py", args + ["--checkpoint-dir", str(ck)]))
    try:
        head = read_until(proc, "Epoch [1/")
        everyone = psutil.Process(proc.pid).children(recursive=True)
        assert len(everyone) >= 4  # 2 ranks, their loader workers, their watchdogs
        for p in [psutil.Process(proc.pid)] + everyone:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        rest, _ = proc.communicate(timeout=120)
    finally:
        _cleanup(proc.pid)
    out = head + rest
    assert re.search(r"^\[STOP\] signal=SIGTERM epoch=\d+ step=\d+ saved=1 exit_code=75$", out,
                     re.M), out[-3000:]
    assert "is killed by signal" not in out


def test_sigterm_during_start_up_is_named_and_immediate(tmp_path):
    """Rank 0 of 2 waits in the process-group start for a rank 1 that never comes (a blocked
    C++ call). Before: SIGTERM killed it with exit 143 and no word."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.Popen([sys.executable, str(REPO / "ddp_train.py"), *RUN,
                             "--dist-timeout", "120"], env=env_for_tests(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = int(env["MASTER_PORT"])
    listening = lambda: any(c.laddr.port == port and c.status == psutil.CONN_LISTEN  # noqa
                            for c in psutil.Process(proc.pid).net_connections())
    assert wait_for(listening, 60), "rank 0 never started its store"
    time.sleep(1)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert time.time() - t0 < 10
    assert "SIGTERM during start-up, before the first training step" in err, out + err


FORK_STORM = """
import os, signal, sys, threading, time
from training import stopping
stopping.catch_stop_signals()
children = []
for _ in range(200):  # each child SIGTERMed the moment it exists, as a pool.terminate() can
    pid = os.fork()
    if pid == 0:
        time.sleep(0.2)
        os._exit(0)
    os.kill(pid, signal.SIGTERM)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print("the children's signals stayed theirs", flush=True)
# the rank's own SIGTERM, sent while it forks without a pause, still stops it
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print("never stopped", flush=True)
"""


def test_a_signal_to_a_just_forked_child_is_not_the_ranks():
    """A child forked a moment ago shares its rank's signal pipe until its after-fork hook
    lets go of it: a SIGTERM sent to it then (a pool's terminate, a DataLoader's shutdown)
    reached the rank as its own, which stopped during start-up (3 of 3 runs of 50 forks).
    The stop signals are now blocked across the fork; the rank's own still stops it."""
    run = subprocess.run([sys.executable, "-c", FORK_STORM], capture_output=True, text=True,
                         cwd=REPO, env=env_for_tests(), timeout=120)
    assert "the children's signals stayed theirs" in run.stdout, run.stderr[-2000:]
    assert run.returncode == 128 + signal.SIGTERM, run.stdout + run.stderr[-2000:]
    assert "SIGTERM during start-up, before the first training step" in run.stderr
    assert "never stopped" not in run.stdout


def test_a_fork_keeps_the_signal_mask_a_thread_chose():
    """The stop signals are blocked across a fork, and afterwards the forking thread has the
    mask it had before: one that blocked SIGTERM on purpose keeps it blocked."""
    code = ("import os, signal\nfrom training import stopping\nstopping.catch_stop_signals()\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])\n"
            "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n"
            "print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env=env_for_tests(), timeout=60)
    assert run.stdout.strip() == f"[{int(signal.SIGTERM)}]", run.stdout + run.stderr


def test_collective_failures_are_told_from_other_errors():
    """The one-line 'collective failed' message is for lost peers and timeouts only: an OOM
    (even one raised inside FSDP's hooks) or a bug keeps its own error."""
    import torch.distributed as dist
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                        "closed by peer [127.0.0.1]:40935")
    assert faults.is_collective_failure(gloo)
    assert faults.is_collective_failure(dist.DistError("anything"))
    assert faults.is_collective_failure(RuntimeError("Timed out waiting 20000ms for recv"))
    assert not faults.is_collective_failure(torch.OutOfMemoryError("CUDA out of memory"))
    assert not faults.is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be "
                                                         "multiplied (4x3 and 5x6)"))
    assert not faults.is_collective_failure(ValueError("gloo"))


# ---- An error with live DataLoader workers ends the process, never hangs --------------------


def _session_processes(session: int) -> list:
    """The processes still alive in the session a test started (start_new_session)."""
    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == session and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass
    return alive


def test_a_bug_with_live_loader_workers_ends_the_process_and_its_workers(tmp_path):
    """Raised on from run(), the error reached the interpreter's exit, where multiprocessing
    sent the loader workers a SIGTERM they ignore and waited for them forever."""
    args = [*RUN[:RUN.index("--num-workers")], "--num-workers", "2",
            *RUN[RUN.index("--num-workers") + 2:]]
    proc = _start([sys.executable, str(REPO / "tests" / "patched_run.py"), "bug_at_step_3",
                   str(tmp_path), "ddp_train.py", *args])
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        _cleanup(proc.pid)
        pytest.fail("the process hung after the error")
    assert proc.returncode == 1, out
    assert "Traceback" in out and "ValueError: a bug planted by the test" in out
    assert ("error: rank 0: the run stopped on an unexpected ValueError (a bug planted by "
            "the test): the traceback above shows where") in out
    assert wait_for(lambda: not _session_processes(proc.pid), 10), "loader workers outlived it"


def test_a_killed_loader_worker_ends_the_job_in_seconds(tmp_path):
    """kill -9 of one DataLoader worker (the out-of-memory killer's way): its rank says so
    and exits, the other rank's collective fails, torchrun ends; before, the rank hung."""
    args = [*LONG[:LONG.index("--num-workers")], "--num-workers", "1",
            *LONG[LONG.index("--num-workers") + 2:], "--dist-timeout", "60"]
    proc = _start(_torchrun("ddp_train.py", args))
    try:
        read_until(proc, "Epoch [1/")
        rank1 = next(w for w in _workers(proc) if w.environ().get("RANK") == "1")
        def loaders():  # the forked loader workers, not the watchdog (python -m training.watchdog)
            return [c for c in rank1.children() if "training.watchdog" not in c.cmdline()]
        assert wait_for(loaders, 30), "rank 1 has no loader worker"
        loaders = loaders()
        t0 = time.monotonic()
        loaders[0].kill()
        out, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung after a loader worker was killed")
    finally:
        _cleanup(proc.pid)
    assert proc.returncode != 0 and elapsed < 60, (elapsed, out[-3000:])
    assert "error: rank 1: a DataLoader worker of this rank died" in out, out[-3000:]
    assert "Traceback" not in out.split("a DataLoader worker of this rank died")[0][-2000:]


# ---- A full disk mid-run -------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs: room for the preflight's estimate and a few checkpoints of the CNN."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py"])
def test_a_full_disk_mid_run_is_one_sentence_and_keeps_the_last_checkpoint(small_disk,
                                                                           script):
    """The disk fills up after the first checkpoint: every rank stops with one sentence
    naming the folder, what is free and what a checkpoint needs (was: OSError and
    inline_container tracebacks on rank 0, a collective failure on rank 1), no temporary file
    or lock is left behind, and the last checkpoint still resumes."""
    ck = small_disk / "ck"
    args = LONG + ["--checkpoint-dir", str(ck), "--checkpoint-every", "4"]
    proc = _start(_torchrun(script, args))
    try:
        assert wait_for(lambda: checkpoint.list_checkpoints(ck) or proc.poll() is not None,
                        120)
        first = checkpoint.list_checkpoints(ck)
        assert first, "no checkpoint before the disk filled"
        with open(small_disk / "filler", "wb") as f:  # fill the file system to the last byte
            try:
                while True:
                    f.write(b"\0" * 2**20)
                    f.flush()
            except OSError:
                pass
        out, _ = proc.communicate(timeout=120)
    finally:
        _cleanup(proc.pid)
    assert proc.returncode == 1, out[-3000:]  # torchrun's 1 (and its own report) ...
    assert f'{script}", line' not in out and "inline_container" not in out, out[-3000:]
    assert contract.EXIT_LINE.format(code=2, rank=0) in out  # ... for the workers' 2
    errors = [l for l in out.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, errors
    assert f"no space left on the file system of {ck} to write ckpt-" in errors[0]
    assert "MiB free, a checkpoint needs about" in errors[0] and "is intact" in errors[0]
    left = sorted(p.name for p in ck.iterdir())
    assert not [n for n in left if n.startswith((".tmp", ".old", faults.LOCK_FILE))], left
    (small_disk / "filler").unlink()
    resumed = run_script(script, RUN + ["--epochs", "1", "--checkpoint-dir", str(ck)],
                         timeout=300)
    check_ok(resumed)
    assert "Resumed from epoch 1, step " in resumed.stdout


# ---- Odd environments: one sentence at once, exit 2 ----------------------------------------


@pytest.mark.parametrize("given, says", [
    ({"WORLD_SIZE": "2"}, "$WORLD_SIZE=2 is set but $RANK is not"),
    ({"RANK": "1"}, "$RANK=1 is set but $WORLD_SIZE is not"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "$RANK=5 does not fit $WORLD_SIZE=2 (ranks run from 0 "
                                       "to 1)"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "$WORLD_SIZE=0 is not a number of processes"),
])
def test_rank_variables_that_do_not_fit_are_one_sentence(monkeypatch, capsys, given, says):
    """Before: WORLD_SIZE or RANK alone trained one process silently; RANK=5 of 2 waited 30 s
    for a rendezvous, then blamed a dead rank under pages of C++ frames."""
    import ddp_train
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in given.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    assert ddp_train.main(RUN) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 10
    assert err.count("\n") == 1 and says in err and "torchrun sets them" in err, err


def test_a_taken_master_port_is_named_with_exit_2():
    """Before: rank 0's rendezvous store could not listen, which read as a failed collective
    ("another rank probably died ... raise --dist-timeout"), exit 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_script("ddp_train.py", RUN, env={"RANK": "0", "WORLD_SIZE": "2",
                                                    "MASTER_ADDR": "127.0.0.1",
                                                    "MASTER_PORT": str(port)}, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"127.0.0.1:{port} is already taken by another program" in proc.stderr
    assert "export another free MASTER_PORT" in proc.stderr


@pytest.mark.parametrize("garbage", [b"", b"\x00\xff\x1b[31mjunk\n", b"somehost\n"])
def test_a_lock_that_names_no_process_is_stale(tmp_path, capsys, garbage):
    """Before: an empty or damaged .lock refused the run for 60 s as "in use by another run
    (host ?, pid ?)", with the garbage bytes in the sentence."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / faults.LOCK_FILE).write_bytes(garbage)
    try:
        faults.lock_checkpoint_dir(ck)
        assert (ck / faults.LOCK_FILE).read_text().split()[1] == str(os.getpid())
    finally:
        faults.release_checkpoint_lock()
    out = capsys.readouterr().out
    assert f"taking over the lock of {ck}: its .lock names no process (empty or damaged)" in out
    assert "junk" not in out and "\x1b" not in out and "somehost" not in out
    assert not (ck / faults.LOCK_FILE).exists()


# ---- A file that is not a checkpoint says what it is --------------------------------------


@pytest.mark.parametrize("kind", ["random bytes", "--save-model file"])
def test_resume_from_a_file_that_is_not_a_checkpoint_says_what_it_is(tmp_path, kind):
    """Before: random bytes gave torch's "weights_only ... In PyTorch 2.6" hint, a --save-model
    file "KeyError: 'model'", and the advice was to give another --checkpoint-dir."""
    path = tmp_path / "thing.pt"
    if kind == "random bytes":
        # starting as a pickle's protocol opcode, as 1 in 256 random files does: torch.load's
        # old-format path warned "Detected pickle protocol 133 in the checkpoint" above the line
        path.write_bytes(b"\x80\x85" + os.urandom(4094))
        says = f"--resume {path} is not a checkpoint: not a file that torch.save wrote"
    else:
        checkpoint.save_model({"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)}, path)
        says = (f"--resume {path} is a model file from --save-model, not a checkpoint: it "
                f"holds the weights only")
    proc = run_script("ddp_train.py", RUN + ["--resume", str(path)], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [l for l in proc.stderr.splitlines() if l.strip()]
    assert says in line and "leave --resume out to start fresh" in line, line
    assert "--checkpoint-dir" not in line.split("give --resume")[0], line
    assert "weights_only" not in line.replace("weights_only=True))", "") and "KeyError" not in line
    if kind == "--save-model file":
        assert "model.load_state_dict(torch.load(PATH, weights_only=True))" in line


def test_ranks_that_found_different_checkpoints_stop_before_training(tmp_path):
    """Two ranks started by hand, each given its own --checkpoint-dir holding another epoch's
    checkpoint (a node-local folder on each node). Before: each rank resumed its own, rank 0
    at epoch 2 and rank 1 at epoch 3, and DDP trained on silently from different points."""
    args = ["--model", "cnn", "--synthetic-size", "64", "--batch-size", "16", "--num-workers",
            "0", "--amp", "off", "--log-every", "0"]
    for name, epochs in (("a", "1"), ("b", "2")):
        check_ok(run_script("ddp_train.py", args + ["--epochs", epochs, "--checkpoint-dir",
                                                    str(tmp_path / name)]))
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, str(REPO / "ddp_train.py"), *args, "--epochs", "3",
         "--checkpoint-dir", str(tmp_path / name), "--dist-timeout", "60"],
        env=env_for_tests({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": port}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, name in enumerate("ab")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    err = outs[0][1]
    assert "the ranks found different checkpoints (rank 0: ckpt-e0001-s0000000; rank 1: " \
           "ckpt-e0002-s0000000, ckpt-e0001-s0000000)" in err, err
    assert "give every node the same, shared --checkpoint-dir" in err
    assert not any("Epoch [" in out for out, _ in outs) and "Traceback" not in err


def test_ranks_with_checkpoints_of_the_same_name_are_told_where(monkeypatch):
    """Each node's own --checkpoint-dir held a checkpoint of the same name: the sentence read
    "rank 0: ckpt-e0001-s0000000; rank 1: ckpt-e0001-s0000000", nothing that differs."""
    found = [["/node-a/ckpt/ckpt-e0001-s0000000"], ["/node-b/ckpt/ckpt-e0001-s0000000"]]
    monkeypatch.setattr(checkpoint, "every_rank", lambda _: found)
    with pytest.raises(faults.UsageError) as refused:
        checkpoint.same_candidates([])
    assert ("the ranks found different checkpoints (rank 0: ckpt-e0001-s0000000 in "
            "/node-a/ckpt; rank 1: ckpt-e0001-s0000000 in /node-b/ckpt)") in str(refused.value)


def test_the_printed_stop_command_stops_torchrun_with_a_checkpoint(tmp_path):
    """SIGUSR1 to torchrun, as "send SIGTERM or SIGUSR1" suggested, killed torchrun (exit
    138) and lost the work since the last checkpoint. The run now says at its start which
    signal to send to which process, and that command checkpoints every rank."""
    proc = _start(_torchrun("ddp_train.py", LONG + ["--checkpoint-dir", str(tmp_path / "ck")]))
    try:
        head = read_until(proc, "Epoch [1/")
        said = re.search(r"^stop with a checkpoint: kill -TERM (\d+) \(torchrun, which passes "
                         r"SIGTERM on to its workers; SIGUSR1 would end torchrun itself\)$",
                         head, re.M)
        assert said and int(said.group(1)) == proc.pid, head[-3000:]
        subprocess.run(["kill", "-TERM", said.group(1)], check=True)
        rest, _ = proc.communicate(timeout=120)
    finally:
        _cleanup(proc.pid)
    assert re.search(r"^\[STOP\] signal=SIGTERM epoch=\d+ step=\d+ saved=1 exit_code=75$",
                     head + rest, re.M), rest[-3000:]
    assert list((tmp_path / "ck").glob("ckpt-*"))


def test_a_wrong_gloo_interface_is_one_sentence_before_any_collective():
    """Before: GLOO_SOCKET_IFNAME=nonexistent read, seconds later and even in one process, as
    a collective that failed because another rank probably died (exit 1)."""
    t0 = time.monotonic()
    proc = run_script("ddp_train.py", RUN, env={"GLOO_SOCKET_IFNAME": "nonexistent"},
                      timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "GLOO_SOCKET_IFNAME='nonexistent' names nonexistent, not an interface with an " \
           "address on this host (" in proc.stderr and "interfaces with an address are lo" in proc.stderr, proc.stderr
    assert "collective" not in proc.stderr and "Epoch [" not in proc.stdout
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("variable, value, backend, world, refused", [
    ("GLOO_SOCKET_IFNAME", "eth0", "gloo", 1, None),
    ("GLOO_SOCKET_IFNAME", "eth0,ib0", "gloo", 1, "names ib0,"),  # gloo opens every one
    ("GLOO_SOCKET_IFNAME", "docker0", "gloo", 1, "names docker0,"),  # there, no address
    ("GLOO_SOCKET_IFNAME", "ib0", "nccl", 1, None),  # one process on NCCL: no gloo group
    ("GLOO_SOCKET_IFNAME", "ib0", "nccl", 2, "names ib0,"),  # the stop vote's gloo group
    ("NCCL_SOCKET_IFNAME", "eth", "nccl", 2, None),  # a prefix
    ("NCCL_SOCKET_IFNAME", "ib,eth1", "nccl", 2, "lets NCCL use no interface"),
    ("NCCL_SOCKET_IFNAME", "=eth", "nccl", 2, "lets NCCL use no interface"),  # exact names
    ("NCCL_SOCKET_IFNAME", "=eth0:4000", "nccl", 2, None),
    ("NCCL_SOCKET_IFNAME", "^lo,docker", "nccl", 2, None),  # leaves eth0
    ("NCCL_SOCKET_IFNAME", "^lo,eth", "nccl", 2, "lets NCCL use no interface"),
    ("NCCL_SOCKET_IFNAME", "docker", "nccl", 2, "lets NCCL use no interface"),  # no address
    ("NCCL_SOCKET_IFNAME", "ib", "gloo", 2, None),  # not NCCL's run
])
def test_socket_interfaces_that_cannot_work_are_refused(monkeypatch, variable, value, backend,
                                                        world, refused):
    from training import distributed
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0"),
                                                         (3, "docker0")])
    monkeypatch.setattr(distributed, "_has_address", lambda name: name in ("lo", "eth0"))
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(variable, value)
    if refused is None:
        distributed.check_socket_interfaces(backend, world)
        return
    with pytest.raises(faults.UsageError) as caught:
        distributed.check_socket_interfaces(backend, world)
    said = str(caught.value)
    assert said.startswith(f"{variable}={value!r} ") and refused in said, said
    assert "this host's interfaces with an address are lo, eth0 (without one: docker0)" in said
    assert "\n" not in said


def test_a_taken_master_port_ends_every_rank_of_a_launch_by_hand_with_a_sentence():
    """Two processes started by hand while another program listens at MASTER_PORT. Before:
    rank 0 said so, but rank 1 waited without a word, beyond --dist-timeout, as long as that
    program held the port (torch's store client waits for its handshake with no timeout).
    The wait for rank 0's answer is min(distributed.RANK0_ANSWER_S, --dist-timeout): 5 s here."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        t0 = time.monotonic()
        procs = [subprocess.Popen(
            [sys.executable, str(REPO / "ddp_train.py"), *RUN, "--dist-timeout", "5"],
            env=env_for_tests({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": port}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        try:
            outs = [p.communicate(timeout=60) for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert time.monotonic() - t0 < 60
    assert [p.returncode for p in procs] == [2, 2], outs
    assert f"127.0.0.1:{port} is already taken by another program" in outs[0][1], outs[0][1]
    err = outs[1][1]
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert f"error: rank 1: no rank 0 answered at 127.0.0.1:{port} within 5 s: the port may " \
           f"be taken by another program (rank 0 then says so) or rank 0 died" in err, err
    from training import distributed
    assert distributed.RANK0_ANSWER_S <= 20  # with the default --dist-timeout: within 60 s
