"""Checkpoint/resume, stop signals, dead ranks, preflight, bad images and NaN losses (CPU)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from training import checkpoint, contract, faults, models
from conftest import (REPO, check_ok, env_for_tests, epoch_lines, metrics, read_until, run_script,
                      wait_for)

# 20 steps per epoch at 1 x 16 (10 per rank at 2 x 16... per rank 160 samples / 16 = 10)
RUN = ["--model", "cnn", "--synthetic-size", "320", "--batch-size", "16", "--epochs", "2",
       "--num-workers", "0", "--amp", "off", "--seed", "7", "--lr", "0.02"]


def _torchrun(script, args, nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(REPO / script), *args]


def _start(cmd):
    # SIGINT as in a terminal: a suite started in the background (`cmd &` in a script) hands
    # its children SIGINT ignored, and Python then never raises KeyboardInterrupt
    return subprocess.Popen(cmd, env=env_for_tests(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _children(pid):
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _kill_job(proc):
    """SIGKILL torchrun and its workers (torchrun starts them in their own sessions)."""
    for pid in _children(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _same_weights(a, b):
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.pt"
    check_ok(run_script("ddp_train.py", RUN + ["--save-model", str(path)], nproc=2))
    return path


@pytest.mark.parametrize("script,extra", [("ddp_train.py", []), ("fsdp_train.py", []),
                                          ("ddp_train.py", ["--zero1"])])
def test_killed_after_first_checkpoint_resumes_to_same_weights(uninterrupted, tmp_path, script,
                                                               extra):
    """SIGKILL to the whole job after its first checkpoint, then a rerun: the same weights as
    the uninterrupted DDP run (FSDP's and ZeRO-1's equal DDP's; ZeRO-1's checkpoint gathers
    every rank's part of the momentum first)."""
    ck = tmp_path / "ck"
    args = RUN + extra + ["--checkpoint-dir", str(ck), "--checkpoint-every", "3"]
    proc = _start(_torchrun(script, args, 2))
    assert wait_for(lambda: checkpoint.list_checkpoints(ck) or proc.poll() is not None)
    _kill_job(proc)  # the whole job, as a node failure would
    assert checkpoint.list_checkpoints(ck), "no checkpoint before the kill"
    resumed = run_script(script, args + ["--save-model", str(tmp_path / "r.pt")], nproc=2)
    check_ok(resumed)
    assert "Resumed from epoch 1, step " in resumed.stdout
    _same_weights(uninterrupted, tmp_path / "r.pt")
    m = metrics(resumed.stdout)[-1]
    assert m["epoch"] == "2" and m["train_images"] == "320"  # the epoch is counted whole
    assert len(checkpoint.list_checkpoints(ck)) == 2  # --keep-checkpoints 2


def test_sigusr1_checkpoints_exits_75_and_resumes(tmp_path):
    """What the Slurm launcher does before the time limit: USR1 to every training process.
    Sent when epoch 1 of 6 is printed (handlers installed, most of the run still ahead), so the
    test does not depend on how fast this machine trains."""
    long_run = [a if a != "2" else "6" for a in RUN]  # --epochs 6
    assert long_run[long_run.index("--epochs") + 1] == "6"
    ref = tmp_path / "ref.pt"
    check_ok(run_script("ddp_train.py", long_run + ["--save-model", str(ref)], nproc=2))
    ck = tmp_path / "ck"
    args = long_run + ["--checkpoint-dir", str(ck)]
    proc = _start(_torchrun("ddp_train.py", args, 2))
    head = read_until(proc, "Epoch [1/6]")
    for child in _children(proc.pid):
        os.kill(child, signal.SIGUSR1)
    rest, _ = proc.communicate(timeout=240)
    out = head + rest
    assert proc.returncode != 0, out
    assert "SIGUSR1: checkpoint saved at epoch" in out
    assert f"exiting with code {contract.REQUEUE_EXIT} to be requeued" in out
    assert "Epoch [6/6]" not in out  # it really stopped early
    resumed = run_script("ddp_train.py", args + ["--save-model", str(tmp_path / "r.pt")],
                         nproc=2)
    check_ok(resumed)
    assert "Resumed from epoch" in resumed.stdout
    _same_weights(ref, tmp_path / "r.pt")


@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py", "dp_train.py",
                                    "export_model.py", "prepare_tinyimagenet.py"])
def test_ctrl_c_while_torch_loads_ends_the_script_without_a_traceback(script):
    """Importing torch takes seconds (tens of them on a cluster's shared file system), and a
    Ctrl-C then was a 30-line traceback of torch's internals. The script now ends at once,
    as killed by SIGINT; a SIGINT ignored, as a background job's, stays ignored."""
    def start(handler):
        # -X importtime: a line per module as its import ends, so the signal is sent while
        # torch's submodules load, whatever this machine's speed
        return subprocess.Popen([sys.executable, "-X", "importtime", str(REPO / script),
                                 "--help"], env=env_for_tests(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, handler))

    for handler, ended in ((signal.SIG_DFL, -signal.SIGINT), (signal.SIG_IGN, 0)):
        proc = start(handler)
        while not re.search(r"\|\s+torch\.", line := proc.stderr.readline()):
            assert line, "the script ended before it imported torch"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        said = [line for line in err.splitlines() if not line.startswith("import time:")]
        assert proc.returncode == ended and said == [], (handler, said)
        assert ("usage:" in out) == (handler == signal.SIG_IGN)  # ignored: it went on


def _signal_after_first_checkpoint(script, sig, ck, nproc=None) -> tuple:
    """Run ``script`` as one process (or ``nproc`` ranks under torchrun) for 30 epochs, send
    ``sig`` once its first checkpoint is in ``ck``; (the process, its whole output)."""
    args = [*RUN, "--epochs", "30", "--checkpoint-dir", str(ck)]
    proc = _start(_torchrun(script, args, nproc) if nproc else
                  [sys.executable, str(REPO / script), *args])
    assert wait_for(lambda: checkpoint.list_checkpoints(ck) or proc.poll() is not None)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    return proc, out


def test_dp_sigterm_exit_code_is_75(tmp_path):
    proc, out = _signal_after_first_checkpoint("dp_train.py", signal.SIGTERM, tmp_path / "ck")
    assert proc.returncode == contract.REQUEUE_EXIT, out
    assert "SIGTERM: checkpoint saved" in out


@pytest.mark.parametrize("nproc", [None, 1])
def test_a_stop_without_a_checkpoint_dir_is_no_requeue(nproc):
    """SIGTERM to a run without --checkpoint-dir: it exited 75, the code that says "requeue and
    it resumes", though a requeue would start over. Now the signal's own code, 143; under
    torchrun (which reports it as 1) in the [EXIT] line that launch/job.sh reads."""
    args = [*RUN, "--epochs", "30"]
    proc = _start(_torchrun("ddp_train.py", args, nproc) if nproc else
                  [sys.executable, str(REPO / "ddp_train.py"), *args])
    head = read_until(proc, "Epoch [1/30]")  # the run is training
    for pid in _children(proc.pid) if nproc else [proc.pid]:  # the training process(es)
        os.kill(pid, signal.SIGTERM)
    out = head + proc.communicate(timeout=120)[0]
    assert proc.returncode == (1 if nproc else 143), out[-3000:]
    assert ("SIGTERM: stopping without a checkpoint (no --checkpoint-dir), so a requeue would "
            "start over; exiting with code 143\n") in out, out[-3000:]
    assert re.search(r"^\[STOP\] signal=SIGTERM .* saved=0 exit_code=143$", out, re.M), out
    assert ("[EXIT] code=143 rank=0" in out) == bool(nproc), out[-3000:]


def test_ctrl_c_is_one_line_and_releases_the_checkpoint_dir(tmp_path):
    """Before: Ctrl-C (SIGINT) printed a KeyboardInterrupt traceback and left the checkpoint
    dir's lock behind."""
    ck = tmp_path / "ck"
    proc, out = _signal_after_first_checkpoint("ddp_train.py", signal.SIGINT, ck)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert [l for l in out.splitlines() if l.startswith("error:")] == [
        "error: interrupted (Ctrl-C); nothing was saved since the last checkpoint. To stop "
        "with a checkpoint, run the command of the start-up line 'stop with a checkpoint: ...' "
        "(SIGTERM to torchrun, never SIGUSR1), or under Slurm scancel --signal=USR1"]
    assert not (ck / faults.LOCK_FILE).exists()


def _ctrl_c_default():
    """A child's SIGINT as a terminal gives it: a test run started in the background (or by a
    CI runner) has it ignored, which the child would inherit and keep (nohup's rule)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_a_checkpoint_is_written_stops_once_it_is_whole(tmp_path):
    """Ctrl-C raised its KeyboardInterrupt wherever the main thread was: inside torch.save it
    left no checkpoint, or a RuntimeError traceback from torch's zip writer ("unexpected pos",
    seen in 1 of 8 Ctrl-C's to a launcher run at an epoch's end). Now the checkpoint being
    written is completed first, then the run stops with its one sentence."""
    ck = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "patched_run.py"),
                           "ctrl_c_in_the_first_save", str(tmp_path), "ddp_train.py", *RUN,
                           "--checkpoint-dir", str(ck)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env_for_tests(), preexec_fn=_ctrl_c_default)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "ctrl_c_sent").exists() and proc.returncode == 130, out[-3000:]
    assert "Ctrl-C: stopping once the checkpoint being written is complete" in out, out[-3000:]
    assert "Traceback" not in out and "error: interrupted (Ctrl-C)" in out, out[-3000:]
    (saved,) = checkpoint.list_checkpoints(ck)  # epoch 1's, whole: it loads
    assert torch.load(saved, weights_only=False)["epoch"] == 1
    assert not list(ck.glob(".tmp-*")) and not (ck / faults.LOCK_FILE).exists()


def test_a_second_ctrl_c_does_not_wait_for_the_checkpoint():
    """A checkpoint stuck in a collective (a peer gone) must not hold Ctrl-C for ever."""
    code = ("import signal, threading\n"
            "from training import stopping\n"
            "stopping.catch_stop_signals()\n"
            "done = []\n"
            "try:\n"
            "    with stopping.holding_ctrl_c():\n"
            "        signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
            "        done.append('held')\n"
            "        signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
            "        done.append('not held')\n"
            "except KeyboardInterrupt:\n"
            "    print(done)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env_for_tests(),
                          preexec_fn=_ctrl_c_default)
    assert proc.stdout == "['held']\n", proc.stdout + proc.stderr
    assert "Ctrl-C again to stop at once" in proc.stderr


def test_a_ctrl_c_that_breaks_torch_save_is_a_ctrl_c(tmp_path, monkeypatch):
    """A second Ctrl-C does not wait for the checkpoint: torch.save's zip writer, cut by it,
    raised a RuntimeError ("unexpected pos") on its way out, reported as a crash with a
    traceback. It is the Ctrl-C it is, and no temporary file is left."""
    def cut_save(obj, f):
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
    monkeypatch.setattr(torch, "save", cut_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_save({"x": 1}, tmp_path / "ckpt-e0001-s0000000")
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_does_not_end_after_ctrl_c_is_ended_with_its_sentence():
    """A ``finally`` or ``with`` exit that waits for ever on the KeyboardInterrupt's way up
    kept a worker silent until torchrun's SIGKILL 30 s later (seen once, at an epoch's end)."""
    code = ("import signal, threading, time\n"
            "from training import stopping\n"
            "stopping.catch_stop_signals()\n"
            "stopping.CTRL_C_GRACE_S = 1\n"
            "try:\n"
            "    signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
            "finally:\n"
            "    time.sleep(600)  # a cleanup that never ends\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env_for_tests(),
                          preexec_fn=_ctrl_c_default)
    assert proc.returncode == 130 and time.monotonic() - t0 < 60, proc.stderr
    assert proc.stderr.startswith("error: interrupted (Ctrl-C), and rank 0 was still running "
                                  "1 s later: ending it now; its main thread was here:\n"), (
        proc.stderr)
    assert proc.stderr.endswith('File "<string>", line 8, in <module>\n'), proc.stderr


def test_ctrl_c_without_a_checkpoint_dir_says_nothing_is_saved():
    """It spoke of "the last checkpoint" and a command to stop with one, for a run that saves
    none."""
    proc = _start([sys.executable, str(REPO / "ddp_train.py"), *RUN, "--epochs", "30"])
    read_until(proc, "Epoch [1/30]")  # the run is training
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-3000:]
    assert [l for l in out.splitlines() if l.startswith("error:")] == [
        "error: interrupted (Ctrl-C); this run saves no checkpoint (no --checkpoint-dir), so a "
        "rerun starts over"], out[-3000:]


def test_ctrl_c_to_torchrun_leaves_no_watchdog_traceback(tmp_path):
    """torchrun hands Ctrl-C to each worker's process group, where the worker's watchdog
    (training/watchdog.py) sat in select() with SIGINT's default: a KeyboardInterrupt
    traceback of its own above the worker's one-line error, for every rank."""
    proc, out = _signal_after_first_checkpoint("ddp_train.py", signal.SIGINT, tmp_path / "ck",
                                               nproc=1)
    assert "error: interrupted (Ctrl-C)" in out, out[-3000:]
    assert "watchdog.py" not in out and "KeyboardInterrupt" not in out, out[-3000:]


def _usr1_at_last_step(tmp_path, stop_epoch: int) -> tuple:
    args = RUN + ["--checkpoint-dir", str(tmp_path / "ck")]
    cmd = [sys.executable, str(REPO / "tests" / "patched_run.py"), "usr1_at_an_epochs_last_step",
           str(tmp_path), "ddp_train.py", *args]
    return args, subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                                env=env_for_tests({"STOP_EPOCH": str(stop_epoch)}))


def test_a_stop_at_an_epochs_last_step_saves_the_finished_epoch(tmp_path):
    """Before: a stop seen at an epoch's last step saved (epoch, last step), and the resumed
    run trained an epoch with no step left: its line said 0 images at 0 img/s. Now the epoch
    ends first (its line, its end checkpoint), then the run stops for the requeue."""
    args, stopped = _usr1_at_last_step(tmp_path, stop_epoch=0)
    assert stopped.returncode == contract.REQUEUE_EXIT, stopped.stdout + stopped.stderr
    assert [(m["epoch"], m["train_images"]) for m in metrics(stopped.stdout)] == [("1", "320")]
    assert "[STOP] signal=SIGUSR1 epoch=2 step=0 saved=1 exit_code=75" in stopped.stdout
    resumed = run_script("ddp_train.py", args + ["--save-model", str(tmp_path / "r.pt")])
    check_ok(resumed)
    assert "Resumed from epoch 2, step 0" in resumed.stdout
    assert [(m["epoch"], m["train_images"]) for m in metrics(resumed.stdout)] == \
        [("2", "320"), ("2", "320")]  # epoch 2, then the final line
    check_ok(run_script("ddp_train.py", RUN + ["--save-model", str(tmp_path / "ref.pt")]))
    _same_weights(tmp_path / "ref.pt", tmp_path / "r.pt")  # as if never stopped


def test_a_stop_at_the_last_epochs_last_step_just_finishes(tmp_path):
    _args, done = _usr1_at_last_step(tmp_path, stop_epoch=1)
    check_ok(done)
    assert "[STOP]" not in done.stdout and metrics(done.stdout)[-1]["final"] == "1"


def test_fsdp_checkpoint_resumes_at_another_world_size(uninterrupted, tmp_path):
    """Sharded DCP checkpoint written by 2 ranks, read by 1 rank with the same global batch:
    the run ends where the uninterrupted 2-rank run ends (which equals DDP's)."""
    ck = tmp_path / "ck"
    first = run_script("fsdp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck)],
                       nproc=2)
    check_ok(first)
    (latest,) = checkpoint.list_checkpoints(ck)[:1]
    assert latest.is_dir() and (latest / "meta.pt").is_file()
    assert len(list(latest.glob("*.distcp"))) == 2  # one shard file per rank
    args = RUN[:]
    args[args.index("--batch-size") + 1] = "32"
    resumed = run_script("fsdp_train.py", args + ["--checkpoint-dir", str(ck), "--save-model",
                                                  str(tmp_path / "r.pt")])
    check_ok(resumed)
    assert "Resumed from epoch 2, step 0" in resumed.stdout
    _same_weights(uninterrupted, tmp_path / "r.pt")
    # the sharded checkpoint can also be turned into one plain file without any process group
    out = tmp_path / "full.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils",
                    "dcp_to_torch", str(checkpoint.list_checkpoints(ck)[0]), str(out)], check=True,
                   capture_output=True, env=env_for_tests())
    assert set(torch.load(out, weights_only=True)["model"]) == \
        set(torch.load(tmp_path / "r.pt", weights_only=True))


def test_corrupt_newest_checkpoint_falls_back_with_warning(tmp_path):
    ck = tmp_path / "ck"
    check_ok(run_script("ddp_train.py", RUN + ["--checkpoint-dir", str(ck)]))
    newest, previous = checkpoint.list_checkpoints(ck)
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a full disk
    proc = run_script("ddp_train.py", RUN + ["--epochs", "3", "--checkpoint-dir", str(ck)])
    check_ok(proc)
    assert f"warning: checkpoint {newest} is unusable" in proc.stdout
    assert f"Resumed from epoch 2, step 0 ({previous})" in proc.stdout
    # none usable: a clear error, not a silent fresh start
    for p in checkpoint.list_checkpoints(ck):
        p.write_bytes(b"garbage")
    proc = run_script("ddp_train.py", RUN + ["--epochs", "5", "--checkpoint-dir", str(ck)])
    assert proc.returncode == 2
    assert "could be loaded" in proc.stderr and "--resume never" in proc.stderr


@pytest.mark.parametrize("script", ["ddp_train.py", "dp_train.py"])
def test_an_epoch_resumed_mid_way_reports_the_whole_epoch(tmp_path, script):
    """Before: the epoch resumed from a checkpoint inside it reported only the steps after the
    checkpoint (train_images=1024 of 4096, a fourth of the time), an outlier on every epoch
    chart. The checkpoint now carries the epoch's figures so far. And in a warm-up the resumed
    epoch said LR 0.008750 for the whole run's 0.001250 (the rate at the checkpoint's step):
    it is the rate this run's schedule began the epoch at, with another --lr too."""
    ck = tmp_path / "ck"
    args = RUN + ["--epochs", "1", "--warmup-epochs", "1"]  # 320 samples, 16 a step: 20 steps
    whole = run_script(script, args + ["--checkpoint-dir", str(ck), "--checkpoint-every", "15",
                                       "--keep-checkpoints", "3"])
    check_ok(whole)
    mid = ck / checkpoint.checkpoint_name(0, 15)
    earlier = torch.load(mid, weights_only=True)["earlier"]
    assert earlier["train_sums"][2] == 15 * 16 and earlier["train_time_s"] > 0
    resumed = run_script(script, args + ["--resume", str(mid)])
    check_ok(resumed)
    (a,), (b,) = metrics(whole.stdout)[:1], metrics(resumed.stdout)[:1]
    assert a["train_images"] == b["train_images"] == "320"
    assert float(b["train_loss"]) == pytest.approx(float(a["train_loss"]), rel=1e-6)
    assert (b["train_acc"], b["val_acc"]) == (a["train_acc"], a["val_acc"])
    assert b["lr"] == a["lr"]
    doubled = run_script(script, args + ["--lr", "0.04", "--resume", str(mid)])  # RUN's: 0.02
    check_ok(doubled)
    assert float(metrics(doubled.stdout)[0]["lr"]) == pytest.approx(2 * float(a["lr"]))
    assert float(b["epoch_time_s"]) > earlier["train_time_s"]  # the earlier steps' time too
    assert "skipped" not in resumed.stdout  # no images counted as unreadable


def test_a_checkpoint_inside_an_epoch_past_epochs_says_where_it_is(capsys):
    """A checkpoint at epoch 2, step 6, given --epochs 1: 'already past --epochs', then a final
    line of epoch 1, though the weights hold 6 steps of epoch 2 too."""
    from training import measure
    done = dict(strategy="ddp", world_size=1, epoch=1, epochs=2)
    measure.print_final({}, 0.0, trained=False, run=dict(done, epochs=1), at=(1, 6))
    assert capsys.readouterr().out == (
        "nothing to train: the checkpoint (at epoch 2, step 6, whose steps its weights hold "
        "but the final line below does not cover) is past --epochs 1 already\n")


def test_resume_past_the_end_never_and_missing_path(tmp_path):
    ck = tmp_path / "ck"
    first = run_script("ddp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck)])
    check_ok(first)
    again = run_script("ddp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck)])
    check_ok(again)
    assert "nothing to train: the checkpoint (after epoch 1) has done --epochs 1 already\n" \
        in again.stdout
    # the final line repeats the checkpoint's last epoch, so a study sees the run end; this
    # process timed nothing, so its total time is nan rather than a few microseconds
    done, (final,) = metrics(first.stdout)[-1], metrics(again.stdout)
    assert final["total_time_s"] == "nan" and "Total time" not in again.stdout
    assert {k: v for k, v in final.items() if k != "total_time_s"} == \
        {k: v for k, v in done.items() if k != "total_time_s"}
    # DataParallel given DDP's finished checkpoint: its final line said strategy=ddp unexplained
    other = run_script("dp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck)])
    check_ok(other)
    assert ("nothing to train: the checkpoint (after epoch 1) has done --epochs 1 already; the "
            "final line below is its last epoch, which ddp trained on 1 process(es), not this "
            "dp run on 1") \
        in other.stdout, other.stdout
    assert metrics(other.stdout)[0]["strategy"] == "ddp"
    fresh = run_script("ddp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck),
                                              "--resume", "never"])
    check_ok(fresh)
    assert "Resumed" not in fresh.stdout
    bad = run_script("ddp_train.py", RUN + ["--resume", str(tmp_path / "nope.pt")])
    assert bad.returncode == 2 and "no such checkpoint" in bad.stderr
    # the folder of checkpoints given as --resume: named, not "unusable" and set aside
    folder = run_script("ddp_train.py", RUN + ["--resume", str(ck)])
    assert folder.returncode == 2 and "Traceback" not in folder.stderr
    assert (f"--resume {ck} is a folder of checkpoints: pass it as --checkpoint-dir {ck}"
            in folder.stderr)
    # a good checkpoint of another --model: why, and what to do, not "move them away"
    other = run_script("ddp_train.py", RUN + ["--checkpoint-dir", str(ck), "--model", "resnet18"])
    (only,) = checkpoint.list_checkpoints(ck)
    assert other.returncode == 2 and f"checkpoint {only} could not be loaded" in other.stderr
    assert ("or of another --model or --dataset (another number of classes) loads only with "
            "those") in other.stderr
    assert "trying the previous one" not in other.stdout  # there is none
    # FSDP given DDP's checkpoint, a file: "unreadable: its meta.pt (Not a directory); make it
    # readable (chmod ...)", and no word of the other script
    for flags in (["--checkpoint-dir", str(ck)], ["--resume", str(only)]):
        fsdp = run_script("fsdp_train.py", RUN + flags)
        assert fsdp.returncode == 2 and "Traceback" not in fsdp.stderr, fsdp.stderr
        assert ("a checkpoint of another script (fsdp_train.py writes folders, ddp_train.py and "
                "dp_train.py files)") in fsdp.stderr and "chmod" not in fsdp.stderr
        assert "NotADirectoryError: a file, and fsdp_train.py's checkpoints are folders" in \
            fsdp.stdout + fsdp.stderr


@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py"])
def test_resume_with_another_amp_loads_and_warns(tmp_path, script):
    """A GPU run's default --amp depends on the GPU (bf16 on an A100, fp16 on a V100): a job
    requeued onto another GPU type resumes with another one. Before, a checkpoint without fp16
    (its GradScaler disabled, its state {}) was "unusable" for an fp16 run, and so were all."""
    ck = tmp_path / "ck"
    # one step an epoch and one validation batch: fp16 on a CPU trains about 5 images a second
    run = RUN + ["--synthetic-size", "16", "--checkpoint-dir", str(ck)]
    check_ok(run_script(script, run + ["--epochs", "1"]))
    args = run + ["--amp", "fp16"]
    proc = run_script(script, args)
    check_ok(proc)
    assert "Resumed from epoch 2, step 0" in proc.stdout and "unusable" not in proc.stdout
    assert ("warning: the checkpoint was trained with --amp off; this run goes on with --amp "
            "fp16 (another GPU type?), its loss scale starting afresh\n") in proc.stdout
    assert metrics(proc.stdout)[-1]["amp"] == "fp16"
    back = run_script(script, args[:-1] + ["off", "--epochs", "3"])  # fp16's state into off
    check_ok(back)
    assert "Resumed from epoch 3, step 0" in back.stdout
    assert "--amp fp16; this run goes on with --amp off (another GPU type?)\n" in back.stdout


def test_a_checkpoint_that_sorts_before_older_ones_is_kept_and_they_go_aside(tmp_path):
    """A run resumed at fewer steps per epoch (another world size) saved at epoch 1, step 54
    into a folder holding the run it resumed from at step 98 of 128: the names sort by step,
    so --keep-checkpoints 1 deleted the checkpoint just saved, and --resume auto went back to
    step 98. Checkpoints that sort after the one just written now go aside."""
    ck = tmp_path / "ck"
    (ck / "ckpt-e0000-s0000098").mkdir(parents=True)
    settings = checkpoint.Settings(folder=str(ck), resume="auto", every=0, keep=1,
                                   flags={"amp": "off"})
    written = []
    ckpt = checkpoint.Checkpoints(settings, {}, lambda path, state, meta: written.append(path)
                                  or path.mkdir(), None)
    ckpt.steps = 64
    ckpt.save(0, 54)
    assert [p.name for p in checkpoint.list_checkpoints(ck)] == ["ckpt-e0000-s0000054"]
    (aside,) = ck.glob("superseded-*")
    assert [p.name for p in aside.iterdir()] == ["ckpt-e0000-s0000098"]


def test_a_full_disk_names_what_the_superseded_folders_hold(tmp_path):
    """set_aside_checkpoints deletes nothing, so earlier runs' checkpoints set aside can be
    what fills the disk: the full-disk sentence names the superseded-* folders and their
    size (and says nothing of them where there are none)."""
    ck = tmp_path / "ck"
    (ck / "ckpt-e0001-s0000000").mkdir(parents=True)
    (ck / "ckpt-e0001-s0000000" / "shard").write_bytes(b"\0" * 2**20)
    for old in ("ckpt-e0002-s0000000", "ckpt-e0003-s0000000"):
        (ck / old).mkdir()
        (ck / old / "shard").write_bytes(b"\0" * 3 * 2**20)
    assert "superseded" not in str(checkpoint.disk_full_error(ck / "ckpt-e0004-s0000000"))
    checkpoint.set_aside_checkpoints(ck, [ck / "ckpt-e0002-s0000000"], "test")
    checkpoint.set_aside_checkpoints(ck, [ck / "ckpt-e0003-s0000000"], "test")
    text = str(checkpoint.disk_full_error(ck / "ckpt-e0004-s0000000"))
    assert (f"no space left on the file system of {ck} to write ckpt-e0004-s0000000 (") in text
    assert ("MiB free, a checkpoint needs about 1 MiB): free space there (the 2 superseded-* "
            "folder(s) there, earlier runs' checkpoints set aside, hold 6 MiB) or choose "
            "another folder, then resume; the last complete one, ckpt-e0001-s0000000, is "
            "intact") in text, text
    # a file that is no checkpoint (--save-model's, export_model.py's): nothing to resume
    text = str(checkpoint.disk_full_error(ck / "model.pt"))
    assert text.startswith(f"no space left on the file system of {ck} to write model.pt (") \
        and text.endswith(" MiB free): free space there or choose another folder"), text


def test_resume_from_a_path_into_a_used_folder_keeps_its_own_checkpoints(tmp_path):
    """--resume PATH into a --checkpoint-dir that holds a longer run's later checkpoints: each
    checkpoint the run wrote was pruned at once (the others sort newer) though it said saved,
    or written over the other run's of the same name, and --resume auto then went on with the
    other run. Those that sort at or after the one it writes go aside first now."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    short = ["--max-steps-per-epoch", "2"]
    check_ok(run_script("ddp_train.py", RUN + short + ["--epochs", "3", "--checkpoint-dir",
                                                        str(ck)]))
    check_ok(run_script("ddp_train.py", RUN + short + ["--epochs", "1", "--checkpoint-dir",
                                                        str(other)]))
    resumed = run_script("ddp_train.py", RUN + short + [
        "--epochs", "2", "--checkpoint-dir", str(ck), "--resume",
        str(other / checkpoint.checkpoint_name(1, 0))])
    check_ok(resumed)
    assert [p.name for p in checkpoint.list_checkpoints(ck)] == [checkpoint.checkpoint_name(2, 0)]
    (aside,) = ck.glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == [checkpoint.checkpoint_name(2, 0),
                                                       checkpoint.checkpoint_name(3, 0)]
    assert f"note: this run writes {checkpoint.checkpoint_name(2, 0)} next: moved the 2 " \
        f"checkpoint(s) already in {ck}" in resumed.stdout


def test_resume_never_sets_an_older_runs_checkpoints_aside(tmp_path):
    """Before: a fresh run into a folder holding a longer run's checkpoints had its own pruned
    as soon as they were written (the older run's sort newer), and --resume auto then went on
    with the older run. Now they move into superseded-*/, and nothing is deleted."""
    ck = tmp_path / "ck"
    check_ok(run_script("ddp_train.py", RUN + ["--epochs", "3", "--checkpoint-dir", str(ck),
                                              "--max-steps-per-epoch", "2"]))
    older = sorted(p.name for p in checkpoint.list_checkpoints(ck))
    fresh = run_script("ddp_train.py", RUN + ["--epochs", "1", "--checkpoint-dir", str(ck),
                                              "--max-steps-per-epoch", "2", "--resume", "never"])
    check_ok(fresh)
    assert f"moved the {len(older)} checkpoint(s) already in {ck}" in fresh.stdout
    assert [p.name for p in checkpoint.list_checkpoints(ck)] == [checkpoint.checkpoint_name(1, 0)]
    (aside,) = ck.glob("superseded-*")
    assert sorted(p.name for p in aside.iterdir()) == older
    again = run_script("ddp_train.py", RUN + ["--epochs", "2", "--checkpoint-dir", str(ck),
                                              "--max-steps-per-epoch", "2"])
    check_ok(again)
    assert "Resumed from epoch 2, step 0" in again.stdout  # the fresh run's, not the older one


def test_killed_rank_ends_the_job_quickly():
    proc = _start(_torchrun("ddp_train.py", RUN + ["--epochs", "50", "--dist-timeout", "30"], 2))
    assert wait_for(lambda: len(_children(proc.pid)) == 2)
    time.sleep(4)
    victim = max(_children(proc.pid))
    t0 = time.time()
    os.kill(victim, signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _kill_job(proc)
        pytest.fail("the job did not end within 60 s of a rank dying")
    assert proc.returncode != 0
    assert time.time() - t0 < 60
    assert f"(pid: {victim})" in out or "exitcode: -9" in out, out[-2000:]


def test_check_runs_preflight_and_all_reduce_only(check_runs):
    proc = check_runs["ddp_train.py"]
    check_ok(proc)
    assert "check: all-reduce OK across 2 rank(s) (sum 3 == 3)" in proc.stdout
    assert "busbw" in proc.stdout and "Epoch [" not in proc.stdout
    # no --checkpoint-dir: no checkpoint dir claimed as checked
    assert "preflight OK: data, batch size, devices\n" in proc.stdout
    proc = check_runs["fsdp_train.py"]
    check_ok(proc)
    assert "all-reduce OK across 2 rank(s)" in proc.stdout


def test_preflight_unwritable_checkpoint_dir_exits_2():
    proc = run_script("ddp_train.py", ["--model", "cnn", "--checkpoint-dir",
                                       "/etc/hostname/ck"])
    assert proc.returncode == 2
    assert "--checkpoint-dir /etc/hostname/ck: /etc/hostname is a file, not a folder" in \
        proc.stderr and "Traceback" not in proc.stderr


_CLAIM_AS_NOBODY = """
import os, sys
sys.path.insert(0, sys.argv[1])
from training import checkpoint, faults
if os.geteuid() == 0:  # root lists every folder, whatever its mode
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    checkpoint.tidy_checkpoint_dir(sys.argv[2])
except faults.UsageError as err:
    sys.exit(f"error: {err}")
"""


def test_a_checkpoint_dir_that_cannot_be_listed_is_one_sentence():
    """A --checkpoint-dir this user may write and enter but not list (chmod 300): the start's
    tidying of what a crash left (the first listing) was a PermissionError traceback; it is
    one sentence with the chmod that fixes it."""
    import tempfile
    top = tempfile.mkdtemp(prefix="unlistable-")  # not under pytest's root-only tmp dir
    try:
        os.chmod(top, 0o733 if os.geteuid() == 0 else 0o300)  # nobody's: write and enter
        proc = subprocess.run([sys.executable, "-c", _CLAIM_AS_NOBODY, str(REPO), top],
                              capture_output=True, text=True, timeout=120, env=env_for_tests())
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == (
            f"error: --checkpoint-dir {top} cannot be read (permission denied), so its "
            f"checkpoints cannot be found: make it readable (chmod u+rwx {top}) or choose "
            f"another folder")
    finally:
        os.chmod(top, 0o700)
        os.rmdir(top)


def test_preflight_unannotated_val_image_exits_2(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    bad = tmp_path / "tin"
    shutil.copytree(root, bad)
    shutil.copy(bad / "val" / "images" / "val_0.JPEG", bad / "val" / "images" / "extra.JPEG")
    proc = run_script("ddp_train.py", ["--data-dir", str(bad), "--check"])
    assert proc.returncode == 2
    assert "have no line in" in proc.stderr and "extra.JPEG" in proc.stderr


@pytest.fixture
def damaged_tree(tiny_imagenet, tmp_path):
    root, info = tiny_imagenet
    bad = tmp_path / "tin"
    shutil.copytree(root, bad)
    wnid = sorted(info["wnids"])[0]
    (bad / "train" / wnid / "images" / f"{wnid}_0.JPEG").write_bytes(b"")  # zero bytes
    truncated = bad / "train" / wnid / "images" / f"{wnid}_1.JPEG"
    truncated.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return bad, truncated


def test_corrupt_images_are_skipped_and_counted(damaged_tree):
    bad, _ = damaged_tree
    proc = run_script("ddp_train.py", ["--data-dir", str(bad), "--model", "resnet18",
                                       "--epochs", "1", "--batch-size", "16",
                                       "--num-workers", "2"])
    check_ok(proc)
    assert "warning: skipped 2 unreadable training and 0 validation image(s)" in proc.stdout
    assert proc.stderr.count("warning: skipping unreadable image") == 2
    assert metrics(proc.stdout)[-1]["train_images"] == "158"


def test_strict_names_the_corrupt_file(damaged_tree):
    bad, _ = damaged_tree
    proc = run_script("ddp_train.py", ["--data-dir", str(bad), "--model", "resnet18",
                                       "--epochs", "1", "--batch-size", "16", "--strict",
                                       "--num-workers", "1"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unreadable image" in proc.stderr and ".JPEG" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_nan_loss_stops_naming_epoch_and_step_and_keeps_good_checkpoints(tmp_path):
    """...and, as a usage error at 2 ranks, leaves no record of collectives in the temporary
    directory: neither ended in a hang (the folder stayed there, empty or with the records)."""
    ck, tmp = tmp_path / "ck", tmp_path / "tmp"
    tmp.mkdir()
    proc = run_script("ddp_train.py", RUN + ["--lr", "1e9", "--checkpoint-dir", str(ck),
                                             "--checkpoint-every", "1"], nproc=2,
                      env={"TMPDIR": str(tmp)})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "the loss became NaN or inf at epoch 1, step" in out
    usage = run_script("ddp_train.py", ["--data-dir", str(tmp_path / "none")], nproc=2,
                       env={"TMPDIR": str(tmp)})
    assert usage.returncode != 0 and "does not exist" in usage.stderr, usage.stderr[-2000:]
    assert not list(tmp.glob("collectives-*")), list(tmp.rglob("*"))
    for path in checkpoint.list_checkpoints(ck):  # only checkpoints from before the blow-up
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in state["model"].values()), path
    proc = run_script("dp_train.py", RUN + ["--lr", "1e9"])
    assert proc.returncode == contract.NONFINITE_EXIT
    assert "the loss became NaN or inf at epoch 1, step" in proc.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_at_a_larger_world_size_keeps_the_new_ranks_own_seed(monkeypatch, rank):
    """A 1-process checkpoint resumed by 2 ranks: rank 0 gets the saved random state back,
    rank 1 (which the saved run did not have) keeps the seed the script gave it. Rank 0's
    saved state on rank 1 too would give both ranks the same crops and flips."""
    from training import distributed
    torch.manual_seed(0)
    saved = checkpoint.rng_state()
    meta = dict(epoch=1, step=0, metrics={}, rng=[saved], args={"amp": "off"}, path="ck")
    monkeypatch.setattr(checkpoint, "rank_and_world", lambda: (rank, 2))
    monkeypatch.setattr(checkpoint, "load_newest", lambda candidates, load, explicit: meta)
    torch.manual_seed(distributed.seed_for_rank(0, rank))  # as the script seeds each rank
    own = torch.get_rng_state()
    settings = checkpoint.Settings(folder=None, resume="auto", every=0, keep=2,
                                   flags={"amp": "off"})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ckpt = checkpoint.Checkpoints(settings, dict(optimizer=optimizer, scheduler=scheduler), None,
                                  None)
    assert ckpt.resume(10) == (1, 0)
    assert torch.equal(torch.get_rng_state(), saved["torch"] if rank == 0 else own)


def _epoch_lrs(stdout: str) -> dict:
    """{epoch number: the LR its epoch line printed}."""
    return {int(e): float(lr) for e, _, lr, *_ in epoch_lines(stdout)}


def test_resume_at_another_world_size_keeps_the_learning_rate_schedule(tmp_path):
    """The schedule counts steps; a checkpoint's step count used to be read against the new
    run's steps per epoch: 2 ranks x 3 epochs (10 steps each), then 1 process (20 steps)
    printed epoch 5 at 0.002 where an uninterrupted run decays to 0.0002 (--step-size 2)."""
    ck = tmp_path / "ck"
    check_ok(run_script("ddp_train.py", RUN + ["--epochs", "3", "--checkpoint-dir", str(ck)],
                        nproc=2))
    resumed = run_script("ddp_train.py", RUN + ["--epochs", "5", "--checkpoint-dir", str(ck)])
    check_ok(resumed)
    assert _epoch_lrs(resumed.stdout) == {4: 0.002, 5: 0.0002}
    # dp_train.py resuming the same DDP checkpoint, 20 steps per epoch too
    more = run_script("dp_train.py", RUN + ["--epochs", "6", "--checkpoint-dir", str(ck)])
    check_ok(more)
    assert _epoch_lrs(more.stdout) == {6: 0.0002}


def test_a_mid_epoch_resume_at_another_world_size_lands_at_the_same_fraction(tmp_path):
    """Saved at step 5 of 10 (2 ranks), resumed by 1 process at step 10 of its 20, during a
    one-epoch warm-up: the learning rate there is 0.02 x 11/20, as in an uninterrupted
    1-process run (the resume line says it; the epoch line, the rate at the epoch's first
    step, 0.02 x 1/20), and the other half of the epoch's samples is what remains."""
    ck = tmp_path / "ck"
    warm = RUN + ["--warmup-epochs", "1"]
    check_ok(run_script("ddp_train.py", warm + ["--epochs", "1", "--checkpoint-dir", str(ck),
                                                "--checkpoint-every", "5"], nproc=2))
    mid = ck / checkpoint.checkpoint_name(0, 5)
    assert mid.exists()
    resumed = run_script("ddp_train.py", warm + ["--epochs", "1", "--resume", str(mid)])
    check_ok(resumed)
    assert (f"at this run's 20 steps per epoch (the checkpoint's: 10), step 10, learning rate "
            f"{0.02 * 11 / 20:.6f}") in resumed.stdout
    assert _epoch_lrs(resumed.stdout) == {1: pytest.approx(0.02 * 1 / 20, abs=1e-6)}
    # the whole epoch: 5 steps x 32 before the checkpoint (2 ranks), the 10 left x 16 after it
    assert int(metrics(resumed.stdout)[-1]["train_images"]) == 320


@pytest.mark.parametrize("cache", [False, True])
def test_a_mid_epoch_resume_with_augmentation_gives_the_uninterrupted_weights(
        tiny_imagenet, tmp_path, cache):
    """TinyImageNet with random crops and flips, 2 loader workers per rank: resumed from a
    checkpoint in the middle of epoch 2 (as after a kill -9 there), the run ends with the
    weights of the uninterrupted run. On the folder path the workers' random state, which no
    checkpoint holds, used to draw the crops (max weight difference 0.15)."""
    root, _ = tiny_imagenet
    args = ["--data-dir", str(root), "--model", "resnet18", "--batch-size", "8", "--epochs",
            "2", "--num-workers", "2", "--amp", "off", "--seed", "3"]
    if cache:
        args += ["--data-cache", str(tmp_path / "cache")]
    ck = tmp_path / "ck"
    check_ok(run_script("ddp_train.py", args + [
        "--checkpoint-dir", str(ck), "--checkpoint-every", "4", "--keep-checkpoints", "9",
        "--save-model", str(tmp_path / "whole.pt")], nproc=2))
    mid = ck / checkpoint.checkpoint_name(1, 4)  # 10 steps per epoch: step 4 of epoch 2
    assert mid.exists(), sorted(p.name for p in ck.iterdir())
    resumed = run_script("ddp_train.py", args + ["--resume", str(mid), "--save-model",
                                                 str(tmp_path / "resumed.pt")], nproc=2)
    check_ok(resumed)
    assert "Resumed from epoch 2, step 4" in resumed.stdout
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    again = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for k in whole:
        assert torch.equal(whole[k], again[k]), k


def test_a_checkpoint_the_run_may_not_read_is_passed_over_with_the_chmod_that_fixes_it(
        tmp_path, capsys):
    """The newest checkpoint is whole but a file of it may not be read (copied by another
    user, say): the run falls back to the one before, and the warning says how to resume from
    the newest instead. An I/O error gets no chmod: it would not help."""
    newest, previous = tmp_path / "ckpt-e0002-s0000000", tmp_path / "ckpt-e0001-s0000000"

    def load_one(path, why):
        if path == newest:
            raise checkpoint.Damaged(f"unreadable: its __0_0.distcp ({why}, on rank 0)")
        return {"loaded": path}
    for why, hint in [("Permission denied", True), ("Input/output error", False)]:
        got = checkpoint.load_newest([newest, previous], lambda p: load_one(p, why))
        assert got == {"loaded": previous}
        out = capsys.readouterr().out
        assert (f"warning: checkpoint {newest} is unusable (rank 0: unreadable: its "
                f"__0_0.distcp ({why}, on rank 0)); trying the previous one") in out
        assert (f" (to resume from it instead, stop the run, make it readable: chmod -R u+rX "
                f"{newest}, and start it again)" in out) == hint, out


def test_a_checkpoint_of_another_dataset_is_named_by_its_size_mismatch():
    """The same --model trained on another dataset (another number of classes): the warning
    gave load_state_dict's first line alone, "Error(s) in loading state_dict for Net:", and
    the reason, on the line after it, was lost."""
    ten, four = (models.build_model("cnn", n, (3, 32, 32)) for n in (10, 4))
    with pytest.raises(RuntimeError) as failed:
        ten.load_state_dict(four.state_dict())
    said = checkpoint._first_line(failed.value)
    assert said.startswith("RuntimeError: Error(s) in loading state_dict for ")
    assert "size mismatch for " in said and "torch.Size([4" in said, said
    assert checkpoint._first_line(ValueError("one line")) == "ValueError: one line"
