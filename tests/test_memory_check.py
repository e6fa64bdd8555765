"""bench/memory_check.py: the GPU's measured peaks against the memory model as it is now, and
a replay of the backward on the CPU that follows every storage."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import memory_check
from conftest import REPO

CHECK = REPO / "bench" / "memory_check.py"


def _run(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _main(capsys, *args) -> tuple:
    """memory_check's main() in this process, for its refusals: (exit code, stderr). A
    process of its own adds only its start; test_a_refusal_from_the_command_line has one."""
    try:
        code = memory_check.main([str(a) for a in args])
    except SystemExit as done:  # argparse's errors
        code = done.code
    return code, capsys.readouterr().err


def _row(cmd: str, peak: float, predicted: float, **extra) -> str:
    return json.dumps({"label": "ddp cnn", "batch": 32, "image": 32, "kind": "train",
                       "device": "cuda", "amp": "bf16", "peak": peak, "predicted": predicted,
                       "cmd": cmd} | extra)


def test_each_row_is_predicted_again_and_the_eager_rows_give_the_workspace(tmp_path):
    ddp = ("/opt/torch/.venv/bin/python3 /elsewhere/ddp_train.py --model cnn --epochs 2 "
           "--batch-size 32 --data-on-device --synthetic-size 640")
    estimate = subprocess.run([sys.executable, "ddp_train.py", *ddp.split()[2:], "--amp",
                               "bf16", "--estimate-memory", "1"], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
    line = next(t for t in estimate.stdout.splitlines() if t.startswith("[MEMORY]"))
    figures = dict(t.split("=") for t in line.split()[1:])
    now, workspace = float(figures["peak_mib"]), float(figures["workspace_mib"])
    measured = now * 1.02
    rows = tmp_path / "gpu.jsonl"
    rows.write_text("\n".join([
        _row(ddp, measured, now * 1.5),
        _row(ddp + " --cuda-graph", now * 1.04, now * 1.5),  # not eager: no workspace
        _row("python raw_step.py", 10, None, kind="raw"),  # not a training row: left out
        _row("python dp_train.py --data-dir /nowhere --data-cache /nowhere/cache "
             "--data-on-device", 500, 480),
    ]) + "\n")
    proc = _run(rows)
    assert proc.returncode == 0, proc.stderr
    table = [t for t in proc.stdout.splitlines() if t.startswith("| ddp cnn")]
    assert len(table) == 3
    assert table[0].endswith(f"| {measured:,.0f} | {now * 1.5:,.0f} | "
                             f"{now * 1.5 / measured - 1:+.1%} | {now:,.0f} | "
                             f"{now / measured - 1:+.1%} |")
    assert "not predicted here: error: --data-on-device's data are counted from the cache" \
        in table[2]
    assert "within 5%: 1 of 3 rows then; now 2 of the 2 predicted here" in proc.stdout
    held = measured - (now - workspace)
    assert proc.stdout.rstrip().endswith(f"eager rows' 1 configurations held {held:.0f} MiB: "
                                         f"median {held:.0f}")


def _without(key: str) -> str:
    row = json.loads(_row("python ddp_train.py", 100, 90))
    del row[key]
    return json.dumps(row) + "\n"


@pytest.mark.parametrize("text, message", [
    (None, "cannot read"),
    ("{not json\n", "line 1, is not a JSON line"),
    ("[1, 2]\n", "line 1, is not a row of bench/gpu_check.py"),
    (_row("python ddp_train.py", 100, 90, device="cpu") + "\n",
     "no training row measured on a GPU"),
    (_without("cmd"), "line 1, is not a training row of bench/gpu_check.py: it needs a label, "
                      "image, batch, cmd (text) and a peak (a number); missing: cmd"),
    (_row("python ddp_train.py", "100", 90) + "\n", "is not a training row"),
    (_row("python ddp_train.py", 100, "90") + "\n", "is not a training row"),
    (_row("python train.py --model cnn", 100, 90) + "\n",
     "has a command that runs none of ddp_train.py, fsdp_train.py, dp_train.py"),
    (_row("python ddp_train.py --model 'cnn", 100, 90) + "\n",
     "has a command that does not split into words (No closing quotation)"),
    (_without("amp"), "says neither --amp in its command nor an amp"),
])
def test_a_bad_file_is_one_sentence_and_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "rows.jsonl"
    if text is not None:
        path.write_text(text)
    code, stderr = _main(capsys, path)
    assert code == 2 and message in stderr and len(stderr.splitlines()) == 1, stderr


def test_a_refusal_from_the_command_line_is_one_sentence_and_exit_2(tmp_path):
    proc = _run(tmp_path / "rows.jsonl")
    assert proc.returncode == 2 and "cannot read" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("amp", ["bf16", "off"])
def test_the_replay_sees_what_the_forward_saves_and_a_backward_peak_above_it(amp):
    """Its count after the forward, made by following every storage the ops make, equals the
    model's count with saved-tensor hooks (two independent counts of the same bytes, the
    loss's few beside them), and the backward holds little more than that."""
    proc = _run("--backward", "--model", "resnet18", "--image-size", "32", "--batches", "4,8",
                "--amp", amp)
    assert proc.returncode == 0, proc.stderr
    rows = [t.split() for t in proc.stdout.splitlines() if t.split()[:1] in (["4"], ["8"])]
    assert len(rows) == 2
    for batch, counted, replayed, peak, extra, twice_largest in rows:
        assert float(replayed) == pytest.approx(float(counted), abs=0.15)
        assert float(peak) >= float(replayed) and 0 <= float(extra) < 20
        assert float(twice_largest) > 0


@pytest.mark.parametrize("args, message", [
    ([], "give bench/gpu_check.py's JSON lines files, or --backward"),
    (["--backward", "--batches", "4,x"], "--batches 4,x: give batch sizes separated by commas"),
    (["--backward", "--batches", "1"], "--batches: at least 2 each"),
    (["rows.jsonl", "--model", "resnet18"], "--model: for --backward only"),
    (["--backward", "rows.jsonl"], "--backward replays a step and reads no file"),
    # the model's own sentences: one line, exit 2, no traceback
    (["--backward", "--model", "nosuchmodel", "--batches", "4"], "unknown --model 'nosuchmodel'"),
    (["--backward", "--model", "cnn", "--image-size", "8", "--batches", "4"],
     "--model cnn takes 3x32x32 images"),
])
def test_bad_flags_exit_2(capsys, args, message):
    code, stderr = _main(capsys, *args)
    assert code == 2 and message in stderr, stderr
