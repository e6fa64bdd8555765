"""--tensorboard, read back with TensorBoard's own reader (EventAccumulator), no mocks: the epoch
curves are the [METRIC] values, the per-step curve has a point per step and none twice after a
resume, only rank 0 writes, a study shows one run per configuration, and the memory logs'
scalars are analyze_memory.py's figures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard", reason="tensorboard is in requirements.txt")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer  # noqa: E402

from conftest import FAST, REPO, TESTS, check_ok, env_for_tests, metrics, run_script  # noqa: E402

STEPS = 8  # FAST: 256 synthetic samples, 16 per process, 2 processes


def scalars(folder: Path) -> dict:
    """{tag: [(step, value)]} of every event file in ``folder``."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    board = tmp_path_factory.mktemp("tb") / "run"
    proc = run_script("ddp_train.py", FAST + ["--tensorboard", str(board),
                                              "--tensorboard-every", "0", "--log-every", "0"],
                      nproc=2)
    check_ok(proc)
    return board, proc


def test_the_epoch_curves_are_the_metric_lines(two_ranks):
    board, proc = two_ranks
    found = scalars(board)
    ms = metrics(proc.stdout)[:-1]  # one per epoch (the final line repeats the last)
    assert len(ms) == 2
    for key in ("train_loss", "val_loss", "train_acc", "val_acc", "throughput_img_s",
                "epoch_time_s", "peak_mem_mib"):
        assert [s for s, _ in found[f"epoch/{key}"]] == [STEPS, 2 * STEPS]
        assert [v for _, v in found[f"epoch/{key}"]] == pytest.approx(
            [float(m[key]) for m in ms], rel=1e-6), key
    for gpu in (0, 1):  # every rank's peak, as peak_mem_per_gpu_mib lists them
        assert [v for _, v in found[f"epoch/peak_mem_mib_gpu{gpu}"]] == pytest.approx(
            [float(m["peak_mem_per_gpu_mib"].split("/")[gpu]) for m in ms], rel=1e-6)


def test_a_point_per_step_and_only_rank_0_wrote(two_ranks):
    board, proc = two_ranks
    found = scalars(board)
    assert [s for s, _ in found["step/train_loss"]] == list(range(1, 2 * STEPS + 1))
    assert all(0 < v < 10 for _, v in found["step/train_loss"])
    assert [v for _, v in found["step/lr"]] == pytest.approx([0.01] * 2 * STEPS)
    assert len(list(board.glob("events.out.tfevents.*"))) == 1  # one writer: rank 0's
    assert proc.stdout.count("tensorboard: writing to") == 1


def test_configuration_and_hyperparameters_are_there(two_ranks):
    board, _ = two_ranks
    acc = EventAccumulator(str(board), size_guidance={"tensors": 0})
    acc.Reload()
    assert "config/text_summary" in acc.Tags()["tensors"]
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| batch_size | 16 |" in config and "| model | cnn |" in config
    hparams = acc.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info",
            "_hparams_/session_end_info"} <= set(hparams)
    start = hparams["_hparams_/session_start_info"].decode("latin-1")
    assert "world_size" in start and "per_gpu_batch" in start


def test_a_resumed_run_continues_its_curves_without_a_step_twice(tmp_path):
    """Run 3 epochs; then again from the checkpoint of epoch 1, as a requeued job that lost
    its later work would: each step has one point, and the later epochs are the second run's."""
    board, ckpt = tmp_path / "board", tmp_path / "ckpt"
    args = FAST + ["--epochs", "3", "--tensorboard", str(board), "--tensorboard-every", "0",
                   "--checkpoint-dir", str(ckpt), "--keep-checkpoints", "3", "--log-every", "0"]
    check_ok(run_script("ddp_train.py", args))
    first = sorted(ckpt.iterdir())[0]  # the end of epoch 1
    again = run_script("ddp_train.py", args + ["--resume", str(first)])
    check_ok(again)
    assert "Epoch [1/3]" not in again.stdout and "Epoch [3/3]" in again.stdout
    found = scalars(board)
    steps = [s for s, _ in found["step/train_loss"]]
    assert steps == list(range(1, 3 * 16 + 1))  # 256 samples, 16 a step, one process
    ms = metrics(again.stdout)[:-1]
    assert [v for _, v in found["epoch/val_loss"]][1:] == pytest.approx(
        [float(m["val_loss"]) for m in ms], rel=1e-6)


def test_the_default_folder_of_a_run_with_checkpoints_is_found_again(tmp_path):
    """Without the launchers, --tensorboard names the folder after the --checkpoint-dir, so
    the resumed run writes on in it."""
    args = FAST + ["--tensorboard", "--checkpoint-dir", "ck", "--log-every", "0"]
    check_ok(run_script("ddp_train.py", args + ["--epochs", "1"], cwd=tmp_path))
    check_ok(run_script("ddp_train.py", args + ["--epochs", "2"], cwd=tmp_path))
    (board,) = (tmp_path / "runs" / "tensorboard").iterdir()
    assert board.name == "ddp-1n1g-ck"
    assert [s for s, _ in scalars(board)["epoch/val_loss"]] == [16, 32]


def test_a_fresh_start_gets_a_fresh_run_and_the_old_one_stays_readable(tmp_path):
    """--resume never moved the old checkpoints aside but appended to the same TensorBoard
    folder: every curve had its steps twice, going backwards."""
    args = FAST + ["--epochs", "1", "--tensorboard", "--checkpoint-dir", "ck",
                   "--tensorboard-every", "0", "--log-every", "0"]
    check_ok(run_script("ddp_train.py", args, cwd=tmp_path))
    fresh = run_script("ddp_train.py", args + ["--resume", "never", "--lr", "0.02"],
                       cwd=tmp_path)
    check_ok(fresh)
    board = tmp_path / "runs" / "tensorboard" / "ddp-1n1g-ck"
    (aside,) = board.glob("superseded-*")
    assert f"moved the earlier run's TensorBoard curves in runs/tensorboard/ddp-1n1g-ck to " \
           f"runs/tensorboard/ddp-1n1g-ck/{aside.name}" in fresh.stdout
    new, old = scalars(board), scalars(aside)
    for found in (new, old):  # each run's own: one point per step, none twice
        assert [s for s, _ in found["step/train_loss"]] == list(range(1, 17))
        assert [s for s, _ in found["epoch/val_loss"]] == [16]
    assert [v for _, v in new["step/lr"]] == pytest.approx([0.02] * 16)
    assert [v for _, v in old["step/lr"]] == pytest.approx([0.01] * 16)


@pytest.mark.parametrize("flag, run_dir, logdir", [
    ("{tmp}/boards/exp1", None, "{tmp}/boards"),  # was: --logdir {tmp}/boards/exp1, run "."
    ("launcher-default", "{tmp}/runs/ddp-1n2g-42", "{tmp}/runs"),  # was: the run "tensorboard"
    ("auto", None, "runs/tensorboard"),
])
def test_the_printed_command_gives_the_run_its_name(tmp_path, monkeypatch, capsys, flag,
                                                    run_dir, logdir):
    """Following the printed `tensorboard --logdir DIR` named the only run "." in every
    dashboard: DIR held the run's event files themselves."""
    from training import board
    monkeypatch.chdir(tmp_path)
    if run_dir:
        monkeypatch.setenv("RUN_DIR", run_dir.format(tmp=tmp_path))
    else:
        monkeypatch.delenv("RUN_DIR", raising=False)
    settings = board.Settings(tensorboard=flag.format(tmp=tmp_path), every=5, profile=None,
                              checkpoint_dir="ck", flags={})
    info = dict(strategy="ddp", nodes=1, gpus_per_node=2, global_batch=32)
    tb = board.Board(settings, info, steps=4, start_global_step=0)
    tb.close()
    out = capsys.readouterr().out
    assert f"(view: tensorboard --logdir {logdir.format(tmp=tmp_path)})" in out, out
    # TensorBoard's own reader of a logdir names the run after its folder
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / logdir.format(tmp=tmp_path)))
    expected = tb.path.resolve().relative_to((tmp_path / logdir.format(tmp=tmp_path)).resolve())
    assert list(runs.Runs()) == [str(expected)] and str(expected) != "."


def test_without_the_package_the_flag_says_so_and_exits_2():
    proc = subprocess.run([sys.executable, str(TESTS / "no_torch.py"), str(REPO / "ddp_train.py"),
                           *FAST, "--tensorboard"], capture_output=True, text=True, timeout=300,
                          env=env_for_tests({"HIDE_MODULES": "tensorboard"}))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--tensorboard needs the tensorboard package: pip install tensorboard" in proc.stderr
    assert "Traceback" not in proc.stderr and "Epoch [" not in proc.stdout


def test_under_a_launcher_it_is_on_by_default_and_off_on_request(tmp_path):
    on = run_script("ddp_train.py", FAST + ["--epochs", "1"], env={"RUN_DIR": str(tmp_path)})
    check_ok(on)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    off = tmp_path / "off"
    off.mkdir()
    check_ok(run_script("ddp_train.py", FAST + ["--epochs", "1", "--tensorboard", "off"],
                        env={"RUN_DIR": str(off)}))
    assert not (off / "tensorboard").exists()


def test_a_study_shows_one_run_per_configuration(local_study):
    study, _ = local_study
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(study))
    multiplexer.Reload()
    runs = sorted(multiplexer.Runs())
    assert len(runs) == 4 and all(run.endswith("/tensorboard") for run in runs), runs
    assert [run.split("-")[0] + "-" + run.split("-")[1] for run in runs] == [
        "ddp-1n1g", "ddp-1n2g", "fsdp-1n1g", "fsdp-1n2g"]
    for run in runs:
        assert "epoch/val_loss" in multiplexer.Runs()[run]["scalars"]


def test_the_memory_logs_join_the_run_as_analyze_memory_reads_them(tmp_path):
    """analyze_memory.py --tensorboard on a fixture run (two nodes, a requeue): every GPU's
    memory scalars give its Peak and Avg as the summary does; no torch needed for it."""
    run = tmp_path / "run"
    shutil.copytree(TESTS / "fixtures" / "memory" / "timeline_run", run)
    summary = json.loads(subprocess.run(
        [sys.executable, str(REPO / "analyze_memory.py"), "--json", str(run)],
        capture_output=True, text=True, check=True).stdout)
    proc = subprocess.run([sys.executable, str(TESTS / "no_torch.py"),
                           str(REPO / "analyze_memory.py"), "--tensorboard", str(run)],
                          capture_output=True, text=True, timeout=120, env=env_for_tests())
    check_ok(proc)
    assert f"tensorboard: {run / 'tensorboard'}" in proc.stdout
    found = scalars(run / "tensorboard")
    for gpu in summary["gpu"]:
        values = [v for _, v in found[f"gpu_memory_mib/{gpu['node']}/gpu{gpu['gpu']}"]]
        assert (max(values), round(sum(values) / len(values), 2)) == (gpu["peak_mib"],
                                                                      gpu["avg_mib"])
    for cpu in summary["cpu"]:
        values = [v for _, v in found[f"cpu_rss_mib/{cpu['node']}"]]
        assert max(values) == pytest.approx(cpu["peak_rss_mib"], abs=0.01)
    # again: the scalars are replaced, not doubled
    check_ok(subprocess.run([sys.executable, str(REPO / "analyze_memory.py"), "--tensorboard",
                             str(run)], capture_output=True, text=True, timeout=120))
    assert len(list((run / "tensorboard").glob("*.system"))) == 1
    assert scalars(run / "tensorboard") == found
    assert os.path.getsize(next((run / "tensorboard").glob("*.system"))) > 0


_MAKE_AS_NOBODY = """
import os, sys
sys.path.insert(0, sys.argv[1])
from training import faults
if os.geteuid() == 0:  # root writes every folder, whatever its mode
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
for flag, folder in zip(sys.argv[2::2], sys.argv[3::2]):
    try:
        faults.make_folder(folder, flag)
        print(f"{flag}: ok")
    except faults.UsageError as err:
        print(f"error: {err}")
"""


def test_an_existing_folder_the_run_may_not_write_is_one_sentence():
    """--tensorboard on an existing folder this user may not write (read-only, or another
    user's): SummaryWriter's OSError traceback in a thread, exit 1; --profile and
    --checkpoint-dir each checked it in a copy of their own. Now make_folder says so for
    all three, before anything is written."""
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="unwritable-"))  # not under pytest's root-only tmp dir
    (top / "theirs").mkdir()
    (top / "open").mkdir()
    try:
        os.chmod(top / "theirs", 0o555)
        os.chmod(top / "open", 0o777)
        os.chmod(top, 0o755)
        proc = subprocess.run([sys.executable, "-c", _MAKE_AS_NOBODY, str(REPO),
                               "--tensorboard", str(top / "theirs"),
                               "--checkpoint-dir", str(top / "theirs" / "ck"),
                               "--profile", str(top / "open")],
                              capture_output=True, text=True, timeout=120, env=env_for_tests())
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.splitlines() == [
            f"error: --tensorboard {top / 'theirs'}: that folder is not writable: give a "
            f"writable directory",
            f"error: --checkpoint-dir {top / 'theirs' / 'ck'}: cannot create that folder "
            f"(Permission denied): give a writable directory",
            "--profile: ok"]
    finally:
        shutil.rmtree(top)
