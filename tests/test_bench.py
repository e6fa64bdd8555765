"""The benchmark scripts run and print what bench/results/README.md quotes (tiny settings:
the figures themselves are measured by hand, not in the tests)."""

from __future__ import annotations

import json
import os
import time
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, env_for_tests

from bench import gpu_plan, gpu_report, gpu_rows, lanes, process_tree


def run_bench(script, *args, timeout=300):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args],
                          capture_output=True, text=True, env=env_for_tests(), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_input_pipeline_prints_one_line_per_path(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    out = run_bench("input_pipeline.py", "--data-dir", str(root), "--seconds", "0.5",
                    "--batch-size", "16", "--cache-dir", str(tmp_path / "c"))
    rates = dict(re.findall(r"^(folder|cache): (\d+) img/s$", out, re.M))
    assert set(rates) == {"folder", "cache"} and all(int(v) > 0 for v in rates.values()), out


def test_input_pipeline_says_when_the_data_makes_no_batch(tiny_imagenet, tmp_path):
    """Before: 160 images and the default --batch-size 256 made no batch, and the warm-up
    ended in a StopIteration traceback."""
    root, _ = tiny_imagenet
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "input_pipeline.py"),
                           "--data-dir", str(root), "--seconds", "0.5",
                           "--cache-dir", str(tmp_path / "c")],
                          capture_output=True, text=True, env=env_for_tests(), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: {root} has 160 training images, fewer than one "
                                   f"batch of 256: pass --batch-size 160 or less")
    assert not (tmp_path / "c").exists()  # refused before the cache is built


def test_train_throughput_prints_the_four_rows(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    out = run_bench("train_throughput.py", "--data-dir", str(root), "--model", "resnet18",
                    "--batch-size", "8", "--steps", "2", "--repeats", "1",
                    "--cache-dir", str(tmp_path / "c"))
    rows = re.findall(r"^\| (folder|cache|synthetic|plain)[^|]*\| ([\d.]+) \|", out, re.M)
    assert [r[0] for r in rows] == ["folder", "cache", "synthetic", "plain"], out
    assert all(float(r[1]) > 0 for r in rows)


def test_step_overhead_prints_four_variants_with_their_python_calls():
    out = run_bench("step_overhead.py", "--model", "cnn", "--batch-size", "8", "--rounds", "2",
                    "--steps", "2")
    rows = re.findall(r"^(bare|ddp|ddp\+metrics|fsdp) +[\d.]+ ms/step +[+-][\d.]+% +([\d,]+) "
                      r"Python calls/step$", out, re.M)
    assert [name for name, _ in rows] == ["bare", "ddp", "ddp+metrics", "fsdp"], out
    calls = {name: int(n.replace(",", "")) for name, n in rows}
    # FSDP2's hooks and the DTensor optimizer are host work DDP does not do
    assert 0 < calls["bare"] < calls["ddp"] < calls["fsdp"], out
    # a bad count is one sentence, not a median of nothing
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "step_overhead.py"), "--rounds",
                           "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].endswith("--rounds and --steps must be 2 or more (each "
                                                 "round's first step, and the first round, are "
                                                 "warm-up) and --batch-size 1 or more")


def test_gpu_check_runs_on_cpu_with_a_notice(tmp_path):
    out = run_bench("gpu_check.py", "--steps", "2", "--out", str(tmp_path / "report.md"),
                    timeout=600)
    assert "notice: no GPU visible" in out
    report = (tmp_path / "report.md").read_text()
    assert report in out
    rows = re.findall(r"^\| (ddp, synthetic on device|fsdp full, synthetic on device|"
                      r"dp \(one GPU\), synthetic on device|ddp, cache|ddp, JPEG folder) \| "
                      r"64 \| \d+ \| off \| ([\d,]+) \| [\d.]+ \|", report, re.M)
    assert len(rows) == 6 and all(int(v.replace(",", "")) > 0 for _, v in rows), report
    assert report.count("skipped (CUDA only)") == 13
    assert "raw step" not in report  # --rows targets' yardstick: the 8 minutes stay the 8
    # rank 0 of 8 for each ZeRO rung: what it holds beside what the memory model predicts
    held = re.findall(r"^memory at 8 GPUs: (.*), 64 px: held params \+ grads \+ optimizer \+ "
                      r"host ([\d.]+) \+ ([\d.]+) \+ ([\d.]+) \+ "
                      r"([\d.]+) MiB, predicted ([\d.]+) \+ ([\d.]+) \+ ([\d.]+) \+ ([\d.]+);",
                      report, re.M)
    assert [h[0] for h in held] == ["ddp", "ddp --zero1", "fsdp grad-op", "fsdp full",
                                    "fsdp full --offload"], report
    for _, *figures in held:
        got, want = [float(x) for x in figures[:4]], [float(x) for x in figures[4:]]
        assert got == pytest.approx(want, abs=0.06), figures  # [MEMORY] has one decimal
    assert re.search(r"^\| profile: ddp, synthetic on device \| 64 \| 8 \| off \| \| [\d.,]+ \| "
                     r"0 \| ", report, re.M), "the profiled row counts the launches: none on a CPU"
    assert "test suite on this node: skipped: no GPU" in report  # never the suite inside itself
    assert "| 1.00x |" in report  # the ceiling row, against itself
    assert "torch " in report and "date: " in report
    # the launchers on this machine: local.sh's CPU memory log, analyze_memory's summary
    launcher = tmp_path / "report-launcher"
    assert "[" in (launcher / "analyze_memory.txt").read_text()
    assert list(launcher.glob("*.txt")) and (launcher / "timeline.png").is_file()
    # a 2-rank FSDP run killed after its first checkpoint resumes from it and finishes
    assert re.search(r"^\| kill and resume: fsdp_train.py, 2 ranks sharing the GPU \| +\| 16 \| "
                     r"\| passed \|", report, re.M), report
    assert "killed after ckpt-e0000-s0000003; Resumed from epoch 1, step 3" in report
    # one JSON line per row, written as each finished
    lines = [json.loads(line) for line in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert len(lines) == len(re.findall(r"^\| ", report, re.M)) - 1  # all but the header
    ceiling = [line for line in lines if line["label"] == "ddp, synthetic on device"
               and "skipped" not in line]
    assert len(ceiling) == 2 and all(line["img_s"] > 0 for line in ceiling)
    # the timed rows run free of the profiler: the launches are counted in a row of its own
    assert all("--profile" not in line["cmd"] for line in ceiling)
    (profiled,) = [line for line in lines if line["kind"] == "profile" and "skipped" not in line]
    assert profiled["launches"] == 0 and "--profile" in profiled["cmd"]  # none on a CPU
    held_lines = [line for line in lines if line["kind"] == "held"]
    assert len(held_lines) == 5 and all(line["states"] for line in held_lines)
    # each row that ran: its seconds, the lane it ran in (4 by default), what ran beside it
    ran = [line for line in lines if "skipped" not in line]
    assert all(line["seconds"] > 0 for line in ran) and {line["lane"] for line in ran} == {
        0, 1, 2, 3}
    assert {line["lane"] for line in ran if line.get("timed")} == {0}


def test_gpu_check_starts_no_row_it_has_no_time_for(tmp_path):
    """--minutes: a row starts only with the time it needs left; each row's line is written
    at once (here: all of them, none started), and the run says so instead of failing."""
    out = run_bench("gpu_check.py", "--minutes", "0.1", "--out", str(tmp_path / "r.md"),
                    timeout=300)
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    started = [r for r in lines if "skipped" not in r]
    assert not started, started
    assert all(r["skipped"].startswith("not started: ") or r["skipped"] == "skipped (CUDA only)"
               for r in lines)
    assert re.search(r"not started: --minutes 0.1 had no \d+ s left for it", out), out
    assert "FAILED" not in out


def test_gpu_check_names_the_equivalence_test_that_failed(monkeypatch):
    """The first GPU run said "1 failed, 2 passed" and nothing more: which test failed took a
    second run of the lease. The report now carries pytest's FAILED lines."""
    out = ("..F\nFAILED tests/test_strategies.py::test_fsdp_ends_with_the_same_weights_as_ddp"
           "[full] - AssertionError: Tensor-likes are not close!\n1 failed, 2 passed in 55s\n")
    monkeypatch.setattr(gpu_rows, "run_command", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, stdout=out, stderr=""))
    passed, text, fatal = gpu_rows.equivalence_tests(1, 60)
    assert passed is False and fatal == []
    assert text.startswith("1 failed, 2 passed in 55s (1 process(es) per run, NCCL); FAILED "
                           "tests/test_strategies.py::test_fsdp_ends_with_the_same_weights_as_"
                           "ddp[full] - AssertionError")


def test_gpu_check_counts_the_recompilations_inside_the_timed_epoch():
    """--compile rows run with TORCH_LOGS=recompiles; only those inside the second epoch's
    training window (its [METRIC] clock times) count against the measurement."""
    import datetime
    year = datetime.date.today().year
    start = datetime.datetime(year, 11, 26, 12, 0, 10).timestamp()
    log = "\n".join([
        "[rank0]:V1126 12:00:05.100000 1 guards.py:5621] [0/1] [__recompiles] Recompiling "
        "function forward in models.py:32",  # the first epoch's evaluation: before the window
        "[rank0]:V1126 12:00:05.100000 1 guards.py:5621] [0/1] [__recompiles]     - 0/0: "
        "GLOBAL_STATE changed: grad_mode",
        "V1126 12:00:12.500000 1 guards.py:5621] [0/2] [__recompiles] Recompiling function "
        "forward in models.py:32",  # inside
        "V1126 12:00:30.000000 1 guards.py:5621] [0/3] [__recompiles] Recompiling function "
        "forward in models.py:32"])  # the second evaluation: after
    assert gpu_rows.recompiles_between(log, start, start + 15) == 1
    assert gpu_rows.recompiles_between("", start, start + 15) == 0


def test_compile_takes_a_mode():
    from training import flags
    import argparse
    parser = flags.add_common_args(argparse.ArgumentParser())
    assert parser.parse_args(["--compile"]).compile == "default"
    assert parser.parse_args(["--compile", "reduce-overhead"]).compile == "reduce-overhead"
    assert parser.parse_args([]).compile is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--compile", "fastest"])


# --------------------------------------------------------------------------------------------
# gpu_check's lanes, --continue, time estimates and the rank-0-of-8 sizing (issue 48): fake
# rows where no training run is needed, so these take seconds
# --------------------------------------------------------------------------------------------

@pytest.fixture
def gpu_check():
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check
    return gpu_check


def test_gpu_check_times_rows_one_after_another_beside_the_untimed_lanes():
    """The timed rows never overlap one another; the untimed rows run beside them, the one
    that needs the data waits for it, and each result names what ran beside it."""
    Row = gpu_plan.Row
    rows = [Row("timed a", 8), Row("timed b", 8), Row("timed on the cache", 8, needs_data=True),
            Row(gpu_plan.DATA, 0, kind="data"), Row("tests", 0, kind="tests"),
            Row("held", 8, kind="held"), Row("memory", 8, timed=False)]
    spans, recorded = {}, []

    def run_row(row):
        start = time.monotonic()
        time.sleep(0.6 if row.kind == "data" else 0.3)
        spans[row.key] = (start, time.monotonic())
        return {}

    t0 = time.monotonic()
    left = lanes.run_lanes(rows, 3, t0 + 60, lambda row: 1, run_row,
                           lambda row, result: recorded.append((row, result)))
    wall = time.monotonic() - t0
    assert left == [] and sorted(r.key for r, _ in recorded) == sorted(r.key for r in rows)
    timed = sorted(spans[r.key] for r in rows if r.in_timed_lane)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(timed, timed[1:])), timed
    assert wall < 0.8 * (0.3 * 6 + 0.6)  # side by side, not one after another
    assert spans[rows[2].key][0] >= spans[rows[3].key][1]  # the cache row after the data
    lane_of = {row.key: result["lane"] for row, result in recorded}
    assert {lane_of[r.key] for r in rows if r.in_timed_lane} == {0}
    for row, result in recorded:
        assert result["seconds"] >= 0.3
        if row.in_timed_lane:  # beside a timed row only untimed rows ever run
            assert result["beside"] and not {b for b in result["beside"]} & {
                r.key for r in rows if r.in_timed_lane}, result
    # one lane: every row alone, in the plan's order (the data job before the row needing it)
    spans.clear()
    one = rows[:2] + [rows[3], rows[2]] + rows[4:]
    lanes.run_lanes(one, 1, time.monotonic() + 60, lambda row: 1, run_row,
                    lambda row, result: None)
    assert sorted(spans, key=lambda k: spans[k][0]) == [r.key for r in one]


def test_gpu_check_lends_the_last_timed_row_to_an_idle_lane_only_when_it_would_not_start():
    """By the estimates: the timed lane keeps every row it reaches within the budget; a row
    it cannot reach, and no headline, starts in an idle lane instead of not at all."""
    Row = gpu_plan.Row
    rows = [Row("a", 8, headline=True), Row("b", 8, headline=True), Row("c", 8), Row("d", 8),
            Row("tests", 0, kind="tests")]
    runs, left = lanes.simulate_lanes(rows, 2, 100, lambda row: 30)
    lane_of = {row.label: (lane, start) for lane, row, start, _ in runs}
    assert left == [] and lane_of == {"a": (0, 0), "b": (0, 30), "c": (0, 60), "tests": (1, 0),
                                      "d": (1, 30)}, lane_of
    runs, left = lanes.simulate_lanes(rows, 2, 200, lambda row: 30)  # time enough
    assert {row.label for lane, row, *_ in runs if lane == 0} == {"a", "b", "c", "d"}
    runs, left = lanes.simulate_lanes(rows[:2] + rows[4:], 2, 50, lambda row: 30)
    assert [row.label for row in left] == ["b"]  # a headline stays in the timed lane


def test_gpu_check_names_the_fastest_way_at_224_px_once_the_compile_rows_ran():
    """--rows compile: eager, --cuda-graph and each --compile mode at 224 px, batch 256; the
    target is that all were measured, and the line names the fastest."""
    def row(label, img_s):
        return {"label": label, "batch": 256, "image": 224, "img_s": img_s}

    results = [row(gpu_plan.CEILING, 4700.0), row(gpu_plan.GRAPH, 4719.0),
               row(gpu_plan.compiled_label("default"), 5100.0)]
    found = [c for c in gpu_report.targets(results) if "every --compile mode" in c[0]]
    assert found == [("224 px, batch 256: eager, --cuda-graph and every --compile mode measured",
                      False, "3 of 6; the fastest: --compile default, 5,100 img/s")]
    results += [row(gpu_plan.compiled_label(mode), 4000.0) for mode in
                ("reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")]
    assert [c[1] for c in gpu_report.targets(results) if "every --compile" in c[0]] == [True]
    assert not [c for c in gpu_report.targets(results[:2]) if "every --compile" in c[0]]


def test_gpu_check_judges_the_throughput_targets_by_the_fastest_way_and_names_it():
    """64 px batch 1024 >= 50,000 and 224 px batch 256 >= 4,800 img/s: the fastest of eager,
    --cuda-graph and the --compile modes that ran (the H200's figures of 2026-11-28)."""
    def row(label, batch, image, img_s):
        return {"label": label, "batch": batch, "image": image, "img_s": img_s}

    results = [row(gpu_plan.CEILING, 1024, 64, 35057.0), row(gpu_plan.GRAPH, 1024, 64, 49268.0),
               row(gpu_plan.CEILING, 256, 224, 4566.0), row(gpu_plan.GRAPH, 256, 224, 4666.0)]
    wanted = ("64 px, batch 1024 >= 50,000 img/s", "224 px, batch 256 >= 4,800 img/s (H200)")

    def judged(results):
        return [c for c in gpu_report.targets(results) if c[0] in wanted]

    assert judged(results) == [(wanted[0], False, "49,268 with --cuda-graph"),
                               (wanted[1], False, "4,666 with --cuda-graph")]
    results += [row(gpu_plan.compiled_label("default"), 1024, 64, 36908.0),
                row(gpu_plan.compiled_label("reduce-overhead"), 1024, 64, 66961.0),
                row(gpu_plan.compiled_label("reduce-overhead"), 256, 224, 6630.0)]
    assert judged(results) == [(wanted[0], True, "66,961 with --compile reduce-overhead"),
                               (wanted[1], True, "6,630 with --compile reduce-overhead")]
    assert judged(results[:1]) == [(wanted[0], False, "35,057 with eager")]


def _fake_training(row, args, timeout):
    return {"img_s": 100.0, "amp": "off", "step_ms": 80.0, "steps": 2, "warmup_s": 0.5,
            "peak": 900.0, "predicted": 150.0, "recompiles_timed": None, "cmd": ["python"]}


def _small_plan():
    Row = gpu_plan.Row
    return [Row(gpu_plan.CEILING, 8, args=["--data-on-device"]),
            Row(gpu_plan.CEILING, 16, args=["--data-on-device"]),
            Row(gpu_plan.FSDP, 8, "fsdp_train.py", ["--data-on-device"], timed=False)]


def test_gpu_check_continue_runs_only_the_rows_not_yet_there(gpu_check, monkeypatch, tmp_path):
    """--continue keeps the rows a cut run wrote (its half-written last line left out) and
    runs only the others, a row "not started" among them; each new line has its seconds."""
    ran = []
    monkeypatch.setattr(gpu_check, "plan", lambda which, gpu: _small_plan())
    monkeypatch.setattr(gpu_rows, "run_training",
                        lambda row, *a, **k: ran.append(row.key) or _fake_training(row, *a))
    out = tmp_path / "r.md"
    done = {"label": gpu_plan.CEILING, "batch": 8, "image": 64, "kind": "train", "img_s": 123.0,
            "amp": "off", "step_ms": 65.0, "steps": 2, "peak": 800.0, "predicted": 140.0,
            "seconds": 12.0, "device": "cpu", "steps_per_epoch": 3}
    later = {"label": gpu_plan.FSDP, "batch": 8, "image": 64, "kind": "train",
             "skipped": "not started: --minutes 8 had no 20 s left for it"}
    cut = json.dumps({"label": gpu_plan.CEILING, "batch": 16, "image": 64, "img_s": 1})[:40]
    out.with_suffix(".jsonl").write_text(json.dumps(done) + "\n" + json.dumps(later) + "\n" + cut)
    assert gpu_check.main(["--continue", "--out", str(out), "--lanes", "2"]) == 0
    assert sorted(ran) == sorted([f"{gpu_plan.CEILING}, 64 px, batch 16",
                                  f"{gpu_plan.FSDP}, 64 px, batch 8"])
    lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert lines[0] == done and len(lines) == 3
    assert all(line["seconds"] >= 0 and "lane" in line for line in lines[1:])
    report = out.read_text()
    assert "| 123 | 65.0 |" in report and "continued: 1 row(s) from the earlier run" in report
    # without an earlier run to continue: one sentence, exit 2
    assert gpu_check.main(["--continue", "--out", str(tmp_path / "none.md")]) == 2


def test_gpu_check_continue_reruns_a_row_the_end_of_minutes_cut(gpu_check, monkeypatch,
                                                                tmp_path, capsys):
    """A row whose timeout the end of --minutes cut short (a cold --compile row over its
    guess) was a failure, "no result within N s", and --continue never ran it again. It is now
    marked cut, and its next estimate is at least the seconds it had."""
    monkeypatch.setattr(gpu_check, "plan", lambda which, gpu: _small_plan()[:1])

    def overruns(row, args, timeout):  # its timeout ended it
        return {"error": f"no result within {timeout:.0f} s", "cmd": ["python"]}

    monkeypatch.setattr(gpu_rows, "run_training", overruns)
    earlier = tmp_path / "earlier.jsonl"  # a guess of 1 s: the row starts with 3 s left
    earlier.write_text(json.dumps({"label": gpu_plan.CEILING, "batch": 8, "image": 64,
                                   "seconds": 1.0, "device": "cpu", "steps_per_epoch": 3}))
    out = tmp_path / "r.md"
    assert gpu_check.main(["--out", str(out), "--minutes", "0.05", "--estimates",
                           str(earlier)]) == 0
    (row,) = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert row["skipped"] == ("cut short by the end of --minutes 0.05 after 10 s (its "
                              "estimate: 1 s); --continue runs it") and row["at_least_s"] == 10
    capsys.readouterr()
    assert gpu_check.main(["--continue", "--dry-run", "--out", str(out), "--estimates",
                           str(earlier)]) == 0
    assert re.search(rf"^ +0 - +10 s  {re.escape(gpu_plan.CEILING)}, 64 px, batch 8$",
                     capsys.readouterr().out, re.M)
    # a row that ended with its result under the shortened timeout keeps it (a launcher row's
    # analysis goes on past the timeout by design)
    monkeypatch.setattr(gpu_rows, "run_training", _fake_training)
    assert gpu_check.main(["--out", str(tmp_path / "ok.md"), "--minutes", "0.05",
                           "--estimates", str(earlier)]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "ok.jsonl").read_text().splitlines()]
    assert "skipped" not in row and row["img_s"] == 100.0


def test_gpu_check_gives_each_row_its_share_of_the_hosts_cores(gpu_check, monkeypatch, tmp_path):
    """Rows side by side share the host: each row's processes get cores / (rows that can run
    at once) intra-op threads (OMP_NUM_THREADS), named in the report; one the user set is
    kept, and the variable is as it was once gpu_check returns."""
    seen = []
    monkeypatch.setattr(gpu_check, "plan", lambda which, gpu: _small_plan())
    monkeypatch.setattr(gpu_rows, "run_training", lambda row, *a, **k: seen.append(
        os.environ.get("OMP_NUM_THREADS")) or _fake_training(row, *a))
    monkeypatch.setattr(gpu_check.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "r.md"
    # two timed rows one after another, one untimed row beside them: 2 at once, 8 threads
    assert gpu_check.main(["--out", str(out), "--lanes", "4"]) == 0
    assert seen == ["8"] * 3 and "OMP_NUM_THREADS" not in os.environ
    assert "- OMP_NUM_THREADS of each row: 8 (16 cores, 2 row(s) at once)" in out.read_text()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    seen.clear()
    assert gpu_check.main(["--out", str(tmp_path / "again.md"), "--lanes", "4"]) == 0
    assert seen == ["2"] * 3 and os.environ["OMP_NUM_THREADS"] == "2"
    assert "- OMP_NUM_THREADS of each row: '2', as set before the run" in \
        (tmp_path / "again.md").read_text()
    # a failing run leaves it as it was too
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(gpu_check, "run_lanes", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gpu_check.main(["--out", str(tmp_path / "third.md")])
    assert "OMP_NUM_THREADS" not in os.environ


def test_gpu_check_removes_the_folder_it_made_however_it_ends(gpu_check, monkeypatch, tmp_path):
    """Without --work-dir, the run's tree, cache and profile go to a new temporary folder that
    is removed when the run ends, and when it ends on an error too (that one stayed: on a GPU
    node, with its generated tree)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(gpu_check, "plan", lambda which, gpu: _small_plan())
    monkeypatch.setattr(gpu_rows, "run_training", lambda row, *a, **k: _fake_training(row, *a))
    assert gpu_check.main(["--out", str(tmp_path / "r.md")]) == 0
    assert not list(tmp_path.glob("gpu-check-*"))
    made = []
    monkeypatch.setattr(gpu_check, "run_lanes",
                        lambda *a: made.extend(tmp_path.glob("gpu-check-*")) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gpu_check.main(["--out", str(tmp_path / "again.md")])
    assert len(made) == 1 and not made[0].exists(), made


def test_gpu_check_counts_the_rows_that_can_run_at_once(gpu_check):
    Row = gpu_plan.Row
    timed, untimed = Row("a", 8), Row("tests", 0, kind="tests")
    assert timed.in_timed_lane and not untimed.in_timed_lane
    assert gpu_check.rows_at_once([timed, timed], 4) == 1  # --rows compile: all timed
    assert gpu_check.rows_at_once([timed] + [untimed] * 5, 4) == 4
    assert gpu_check.rows_at_once([timed, untimed], 4) == 2
    assert gpu_check.rows_at_once([untimed] * 2, 4) == 2
    assert gpu_check.rows_at_once([timed] + [untimed] * 5, 1) == 1
    assert gpu_check.rows_at_once([], 4) == 1


def test_gpu_check_takes_its_time_estimates_from_an_earlier_run(gpu_check, monkeypatch,
                                                                 tmp_path, capsys):
    """A row's measured seconds are its estimate next time (same device, same steps an epoch):
    a row that took 400 s does not start with 300 s left; one measured at other steps keeps
    the plan's guess."""
    monkeypatch.setattr(gpu_check, "plan", lambda which, gpu: _small_plan())
    earlier = tmp_path / "earlier.jsonl"
    rows = [{"label": gpu_plan.CEILING, "batch": 8, "image": 64, "seconds": 400.0,
             "device": "cpu", "steps_per_epoch": 3},
            {"label": gpu_plan.CEILING, "batch": 16, "image": 64, "seconds": 500.0,
             "device": "cpu", "steps_per_epoch": 30},  # other steps: not this run's row
            {"label": gpu_plan.FSDP, "batch": 8, "image": 64, "seconds": 7.0, "device": "cpu",
             "steps_per_epoch": 3}]
    earlier.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu_check.main(["--dry-run", "--minutes", "5", "--estimates", str(earlier)]) == 0
    out = capsys.readouterr().out
    assert "2 measured before" in out, out
    assert f"not started: {gpu_plan.CEILING}, 64 px, batch 8 (about 400 s)" in out
    assert re.search(rf"^ +0 - +45 s  {re.escape(gpu_plan.CEILING)}, 64 px, batch 16$", out,
                     re.M), out
    assert re.search(rf"^ +0 - +7 s  {re.escape(gpu_plan.FSDP)}, 64 px, batch 8$", out,
                     re.M), out


def test_gpu_check_takes_the_recorded_runs_estimates_and_keeps_an_earlier_run_it_redoes(
        gpu_check, monkeypatch, tmp_path, capsys):
    """A new --out had only the plan's guesses, lower than the recorded runs measured (the
    timed lane planned to end at 480 s of 480 by them); now the runs recorded in
    bench/results are the estimates, the newest measurement of a row winning. Run again at
    the same --out without --continue, the earlier run's rows and report were overwritten;
    now they are kept beside it."""
    monkeypatch.setattr(gpu_check, "plan", lambda which, gpu: _small_plan())
    monkeypatch.setattr(gpu_check, "RECORDED", tmp_path / "results")
    (tmp_path / "results").mkdir()
    for day, seconds in (("2026-11-28", 70.0), ("2026-11-27", 40.0)):  # listed newest first
        (tmp_path / "results" / f"gpu-h200-{day}.jsonl").write_text(json.dumps(
            {"label": gpu_plan.FSDP, "batch": 8, "image": 64, "seconds": seconds,
             "device": "cpu", "steps_per_epoch": 3}) + "\n")
    assert gpu_check.main(["--dry-run", "--minutes", "5"]) == 0
    out = capsys.readouterr().out
    assert "1 measured before" in out, out
    assert re.search(rf"^ +0 - +70 s  {re.escape(gpu_plan.FSDP)}, 64 px, batch 8$", out,
                     re.M), out
    monkeypatch.setattr(gpu_rows, "run_training", _fake_training)
    report = tmp_path / "r.md"
    assert gpu_check.main(["--out", str(report), "--minutes", "1"]) == 0
    first = report.with_suffix(".jsonl").read_text()
    assert len(first.splitlines()) == 3
    capsys.readouterr()
    assert gpu_check.main(["--out", str(report), "--minutes", "1"]) == 0
    (rows,) = tmp_path.glob("r.before-*.jsonl")
    assert rows.read_text() == first and len(list(tmp_path.glob("r.before-*.md"))) == 1
    assert (f"notice: the earlier run at this --out is kept as {rows} and "
            f"{rows.with_suffix('.md')}") in capsys.readouterr().out
    assert len(report.with_suffix(".jsonl").read_text().splitlines()) == 3


def test_gpu_check_leaves_an_estimate_that_is_no_time_to_the_plans_guess(tmp_path):
    """An earlier run's file edited by hand: seconds of NaN (json.dumps writes it), a string,
    a negative number, true. The dry run kept simulating a row of NaN seconds for ever; now
    such a row keeps the plan's guess. (A process of its own: a hang fails, not waits.)"""
    rows = [r for r in gpu_plan.plan("speed", gpu=False) if not r.cuda_only][:4]
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("".join(
        json.dumps({"label": r.label, "image": r.image, "batch": r.batch, "device": "cpu",
                    "steps_per_epoch": gpu_plan.row_steps(r, 3), "seconds": bad}) + "\n"
        for r, bad in zip(rows, [float("nan"), "12", -5.0, True])))
    with open(earlier, "a") as f:  # a good time, at steps an epoch that are no number
        f.write(json.dumps({"label": rows[0].label, "image": rows[0].image, "batch": rows[0].batch,
                            "device": "cpu", "steps_per_epoch": [3], "seconds": 5.0}) + "\n")
    out = run_bench("gpu_check.py", "--dry-run", "--estimates", str(earlier), timeout=120)
    assert "notice: 4 earlier row(s) whose seconds are no time (such as nan)" in out, out
    assert "time estimates: 0 measured before" in out, out


def test_gpu_check_refuses_an_out_it_cannot_write_before_any_row_runs(gpu_check, tmp_path,
                                                                      capsys):
    """--out a folder ended in a traceback after every row had run, its rows in a file beside
    the folder; --out r.jsonl made the report overwrite its own rows. Each is one sentence and
    exit 2 now, before anything runs; so are --minutes nan and a --work-dir that is a file."""
    (tmp_path / "file").write_text("")
    # a report written by hand beside its rows: --continue replaced its analysis with the table
    (tmp_path / "notes.md").write_text("# What the allocation showed\n")
    (tmp_path / "notes.jsonl").write_text("")
    for args, said in [(["--out", str(tmp_path)], "is a folder: give the report a file name"),
                       (["--continue", "--out", str(tmp_path / "notes.md")],
                        f"--out {tmp_path / 'notes.md'} is a report gpu_check did not write"),
                       (["--out", str(tmp_path / "r.jsonl")], "would be its own rows file"),
                       (["--out", str(tmp_path / "file" / "r.md")], "is a file, not a folder"),
                       (["--work-dir", str(tmp_path / "file")], "is a file, not a folder"),
                       (["--work-dir", str(tmp_path / "file" / "w" / "x")], "is a file")]:
        assert gpu_check.main(args) == 2, args
        assert said in capsys.readouterr().err, args
    assert (tmp_path / "notes.md").read_text() == "# What the allocation showed\n"
    with pytest.raises(SystemExit) as refused:
        gpu_check.main(["--dry-run", "--minutes", "nan"])
    assert refused.value.code == 2 and "numbers above 0" in capsys.readouterr().err


def test_gpu_check_sizes_rank_0_of_8_for_the_steps_it_trains():
    """--simulate-world-size trains 2 steps as rank 0 of 8: its synthetic data is what those
    steps read (8 ranks x 2 batches), not 100 steps' worth; at 224 px on a GPU that data
    (float32, train and a quarter more for validation, whole) fits an 80 GB GPU with room."""
    from training import simulate
    held = [row for row in gpu_plan.plan("speed", gpu=True) if row.kind == "held"]
    assert {row.image for row in held} == {64, 224} and len(held) == 10
    for row in held:
        args = gpu_plan.row_args(row, "resnet50", 100, {"profile": "p"})
        samples = int(args[args.index("--synthetic-size") + 1])
        assert samples >= row.batch * simulate.STEPS * 8  # rank 0's 2 steps have their data
        data_mib = (samples + samples // 4) * 3 * row.image ** 2 * 4 / 2 ** 20
        assert data_mib < 0.1 * 80e9 / 2 ** 20, (row.label, row.image, data_mib)


def test_gpu_check_says_when_its_targets_were_timed_beside_other_rows():
    """A speed target judged on a row that shared the GPU with another lane says so under the
    targets, with the way to time each row alone; rows timed alone add nothing."""
    def row(beside):
        return {"label": gpu_plan.GRAPH, "batch": 256, "image": 64, "img_s": 33000.0,
                "step_ms": 7.7, "timed": True, "beside": beside, "kind": "train",
                "amp": "bf16", "peak": 1314.0, "predicted": 1280.0, "warmup_s": 4.5}

    crowded = gpu_report.report([row(["equivalence tests on CUDA"])], [], True, 100, [])
    assert "MISSED: 64 px, batch 256, --cuda-graph >= 35,000 img/s (33,000)" in crowded
    assert ("- judged on 1 timed row(s) that ran beside other rows on the same GPU (each "
            "row's note names them): --lanes 1 times each row alone") in crowded
    alone = gpu_report.report([row([])], [], True, 100, [])
    assert "MISSED: 64 px" in alone and "judged on" not in alone


# --------------------------------------------------------------------------------------------
# The raw step (bench/raw_step.py), its rows and target, --rows targets, and what a crashed rank
# leaves in a row's note (issue 48 follow-up)
# --------------------------------------------------------------------------------------------

def test_raw_step_times_the_plain_step_on_the_cpu():
    from bench import raw_step
    from training import contract
    out = run_bench("raw_step.py", "--mode", "eager", "--device", "cpu", "--model", "cnn",
                    "--batch-size", "4", "--steps", "2", "--warmup", "1", timeout=120)
    (raw,) = [found for found, _ in filter(None, (contract.fields(line, raw_step.RAW_PREFIX)
                                                   for line in out.splitlines()))]
    assert tuple(raw) == raw_step.RAW_KEYS, out
    assert (raw["mode"], raw["model"], raw["image"], raw["batch"], raw["steps"], raw["amp"]) == (
        "eager", "cnn", "32", "4", "2", "off")
    assert float(raw["img_per_s"]) > 0 and float(raw["ms_per_step"]) > 0, out
    assert re.search(r"^cnn, 32 px, batch 4, off, eager: [\d,]+ img/s", out, re.M), out


def test_gpu_check_reads_the_raw_steps_figures():
    """The raw eager row, run as on a CPU (ResNet-18, a few images): its [RAW] line's figures,
    and the command in the row's JSON line."""
    row = next(row for row in gpu_plan.plan("targets", gpu=False)
               if row.label == gpu_plan.RAW_EAGER)
    args = gpu_plan.raw_args(row, "resnet18", 2, gpu=False)
    found = gpu_rows.run_raw(row, args, timeout=120)
    assert "error" not in found, found
    assert found["img_s"] > 0 and found["step_ms"] > 0 and found["steps"] == 2, found
    assert "--mode" in found["cmd"] and "eager" in found["cmd"], found


@pytest.mark.parametrize("flags, why", [(["--device", "cpu"], "--device cpu was given"),
                                        ([], "no GPU is visible")])
def test_raw_step_graph_without_a_gpu_is_one_sentence_and_exit_2(flags, why):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "raw_step.py"), "--mode", "graph",
                           "--model", "cnn", *flags], capture_output=True, text=True,
                          env=env_for_tests({"CUDA_VISIBLE_DEVICES": ""}), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"raw_step.py: error: --mode graph captures the step in a CUDA graph and {why}: use "
        f"--mode eager on the CPU"), proc.stderr


def test_gpu_check_judges_cuda_graph_against_the_raw_graph():
    """64 px, batch 256: --cuda-graph >= 0.97x the raw whole-step graph; "not measured" when
    one of the two rows ran without a figure; nothing when neither was in the run."""
    def row(label, img_s=None):
        found = {"label": label, "batch": 256, "image": 64, "kind": "train"}
        return found | ({"img_s": img_s} if img_s else {"error": "exit 1: boom"})

    what = "64 px, batch 256, --cuda-graph >= 0.97x the raw whole-step graph"

    def judged(results):
        return [c[1:] for c in gpu_report.targets(results) if c[0] == what]

    raw = gpu_plan.RAW_GRAPH
    assert judged([row(gpu_plan.GRAPH, 34700.0), row(raw, 35728.0)]) == [
        (True, "0.97x: 34,700 against 35,728 img/s")]
    assert judged([row(gpu_plan.GRAPH, 33398.0), row(raw, 35728.0)]) == [
        (False, "0.93x: 33,398 against 35,728 img/s")]
    assert judged([row(gpu_plan.GRAPH, 33398.0), row(raw)]) == [
        (None, f"no figure from: {raw}")]
    assert judged([row(gpu_plan.CEILING, 8000.0)]) == []
    report = gpu_report.report([row(gpu_plan.GRAPH, 33398.0) | {"step_ms": 7.7, "amp": "bf16",
                                                                 "peak": 1314.0, "predicted": None},
                                row(raw) | {"kind": "raw"}], [], True, 100, [])
    assert f"- not measured: {what} (no figure from: {raw})" in report


def test_gpu_check_rows_targets_are_the_rows_the_targets_read_in_one_lane(gpu_check, monkeypatch,
                                                                         capsys):
    rows = gpu_plan.plan("targets", gpu=True)
    assert [row.key for row in rows] == [
        f"{gpu_plan.CEILING}, 64 px, batch 256", f"{gpu_plan.GRAPH}, 64 px, batch 256",
        f"{gpu_plan.RAW_EAGER}, 64 px, batch 256", f"{gpu_plan.RAW_GRAPH}, 64 px, batch 256",
        f"{gpu_plan.CEILING}, 64 px, batch 1024", f"{gpu_plan.GRAPH}, 64 px, batch 1024",
        "ddp fp16 (fused SGD), synthetic on device, 64 px, batch 256",
        f"{gpu_plan.CEILING}, 224 px, batch 256", f"{gpu_plan.GRAPH}, 224 px, batch 256",
        f"{gpu_plan.FSDP}, 224 px, batch 256"]
    assert all(row.in_timed_lane and row.headline for row in rows)
    read = [False] * len(rows)
    for order in (1, -1):  # each way round, so that each of eager and graph is once the best
        results = [{"label": row.label, "batch": row.batch, "image": row.image,
                    "img_s": 1000.0 + order * i} for i, row in enumerate(rows)]
        every = gpu_report.targets(results)
        assert len(every) == 7 and None not in [ok for _, ok, _ in every], every
        # a row is read when without it a target changes (its figure) or goes
        read = [was or gpu_report.targets(results[:i] + results[i + 1:]) != every
                for i, was in enumerate(read)]
    # the raw eager row is no target's figure: it shows what the host costs the eager rows
    assert read == [row.label != gpu_plan.RAW_EAGER for row in rows], read
    # one lane unless --lanes says otherwise; the plan fits the default 8 minutes
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(["--dry-run", "--rows", "targets"]) == 0
    out = capsys.readouterr().out
    ends = re.findall(r"^lane (\d+): 10 job\(s\), ends at about (\d+) s$", out, re.M)
    assert len(ends) == 1 and ends[0][0] == "0" and int(ends[0][1]) <= 8 * 60, out
    assert "lane 1" not in out and "not started" not in out, out
    assert gpu_check.main(["--dry-run", "--rows", "targets", "--lanes", "2"]) == 0
    assert "lane 1: 0 job(s)" in capsys.readouterr().out


FAULTHANDLER_DUMP = """\
E       AssertionError: rank 1 exit -11
E       Fatal Python error: Segmentation fault
E
E       Thread 0x00007f01 (most recent call first):
E         File "/repo/training/watchdog.py", line 80 in _watch
E         File "/usr/lib/python3.12/threading.py", line 1010 in run
E
E       Current thread 0x00007f00 (most recent call first):
""" + "".join(f'E         File "/torch/frame{i}.py", line {i} in f{i}\n' for i in range(30)) + \
    "E\nE       Extension modules: numpy\n"


def test_gpu_check_keeps_the_first_lines_of_a_crashed_ranks_stack(monkeypatch):
    """The rows that start ranks run with PYTHONFAULTHANDLER=1; a SIGSEGV's "Fatal Python
    error" and the crashed thread's first frames (15 lines at most) reach the row's note."""
    stack = process_tree.fatal_stack(FAULTHANDLER_DUMP)
    assert stack[0] == "E       Fatal Python error: Segmentation fault"
    assert "Current thread 0x00007f00" in stack[1] and "frame0.py" in stack[2]
    assert len(stack) == 15 and "watchdog" not in "".join(stack)
    assert process_tree.fatal_stack("1 failed, 2 passed") == []
    seen = {}

    def run(cmd, timeout, env):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 1, stdout=FAULTHANDLER_DUMP + "1 failed",
                                           stderr="")
    monkeypatch.setattr(gpu_rows, "run_command", run)
    passed, text, fatal = gpu_rows.equivalence_tests(1, 60, shared=True)
    assert seen["PYTHONFAULTHANDLER"] == "1" and passed is False and fatal == stack
    result = {"label": "equivalence tests, 2 ranks sharing a GPU", "batch": 0, "image": 64,
              "kind": "shared tests", "passed": False, "text": text, "fatal": fatal,
              "error": "see below"}
    report = gpu_report.report([result], [], True, 100, [])
    assert ("equivalence tests, 2 ranks sharing a GPU: where it crashed:\n"
            "    E       Fatal Python error: Segmentation fault\n") in report, report
    assert "frame12.py" in report and "frame13.py" not in report


def test_gpu_check_save_model_row_wants_the_whole_weights(tmp_path):
    """The --save-model row passes on a file torch.load reads with every weight whole, and
    names what is wrong otherwise (a shard's shape, a weight missing, no file)."""
    import torch
    from training import models
    shape, classes = models.synthetic_shape("cnn")
    state = models.build_model("cnn", classes, shape).state_dict()
    torch.save(state, tmp_path / "whole.pt")
    assert gpu_rows.whole_weights("cnn", tmp_path / "whole.pt") is None
    first = next(iter(state))
    torch.save(state | {first: state[first][: len(state[first]) // 2]}, tmp_path / "half.pt")
    assert gpu_rows.whole_weights("cnn", tmp_path / "half.pt") == (
        f"half.pt does not hold the whole weights: 1 of {len(state)} differ or are missing "
        f"({first})")
    assert "1 of" in gpu_rows.whole_weights("cnn", tmp_path / "half.pt")
    torch.save({k: v for k, v in state.items() if k != first}, tmp_path / "less.pt")
    assert f"({first})" in gpu_rows.whole_weights("cnn", tmp_path / "less.pt")
    assert gpu_rows.whole_weights("cnn", tmp_path / "none.pt").startswith(
        "torch.load(none.pt) failed: FileNotFoundError")
    plan = {row.label: row for row in gpu_plan.plan("speed", gpu=True)}
    row = plan["fsdp --save-model, 2 ranks sharing the GPU"]
    assert row.cuda_only and row.kind == "save-model" and not row.in_timed_lane


def test_a_failed_runs_message_keeps_the_first_crash(tmp_path):
    """check_ok (every test's "the run exited 0"): a crash's stack, pushed out of the last
    3,000 characters by the other rank's dump and torchrun's summary, still reaches the
    message, where gpu_check's shared-GPU row reads it."""
    from conftest import check_ok
    stderr = ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call "
              "first):\n  File \"/repo/fsdp_train.py\", line 240 in save_model\n" + "x" * 5000)
    with pytest.raises(AssertionError) as failed:
        check_ok(subprocess.CompletedProcess([], -11, "", stderr))
    assert 'line 240 in save_model' in str(failed.value)
    check_ok(subprocess.CompletedProcess([], 0, "", stderr))  # exit 0: nothing to say


def _described(pid: int) -> str:
    """A process's state letter, parent and command line, as /proc shows them now."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:
        return "gone"
    return f"state {fields[0]}, parent {fields[1]}: {cmdline[:200]}"


def test_gpu_check_interrupted_keeps_its_rows_and_ends_the_running_ones(tmp_path):
    """Ctrl-C (or an allocation's SIGTERM) during the lanes: no traceback, one sentence that
    names --continue, exit 130; the rows it cut are marked interrupted and their processes
    ended, the rest not started, and --continue plans every one of them again."""
    out = tmp_path / "r.md"
    cmd = [sys.executable, "-u", str(REPO / "bench" / "gpu_check.py"), "--out", str(out),
           "--work-dir", str(tmp_path / "w")]
    # Ctrl-C in a terminal: SIGINT handled as by default there, also where this suite runs as a
    # shell's background job (nohup ... &), which starts with SIGINT ignored and would hand that on
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_for_tests(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "rows: appended" in proc.stdout.readline() + proc.stdout.readline()
        deadline = time.monotonic() + 60
        rows = []
        while len(rows) < 2 and time.monotonic() < deadline:  # two rows' processes started
            time.sleep(0.5)
            rows = process_tree.descendants(proc.pid)
        assert rows, "no row started within 60 s"
        proc.send_signal(signal.SIGINT)  # this process alone, not its group
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert re.search(r"^gpu_check: interrupted \(SIGINT\) after \d+ s: \d+ row\(s\) of this run "
                     r"ended and are in .*r\.jsonl; the same command with --continue runs the "
                     r"rest$",
                     stderr, re.M), stderr[-2000:]
    # ended: gone, or a zombie (dead; a process whose parent ended first waits there until
    # the container's init reaps it, which CI's did not within 1 s once)
    deadline = time.monotonic() + 5
    while not all(map(process_tree.exited, rows)) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = {pid: _described(pid) for pid in rows if not process_tree.exited(pid)}
    assert not alive, f"row processes left running: {alive}"
    # nor one started after the signal (kill-and-resume's second torchrun was, once)
    later_runs = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(tmp_path) in cmdline.read_text(errors="replace"):
                later_runs.append(cmdline.parent.name)
        except OSError:
            continue
    assert not later_runs, f"processes of the run left after it: {later_runs}"
    lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    cut = [r for r in lines if r.get("skipped", "").startswith("interrupted after ")]
    later = [r for r in lines if r.get("skipped") == "not started: the run was interrupted"]
    assert cut and later, lines
    assert "interrupted after" in out.read_text()
    plan = subprocess.run(cmd + ["--continue", "--dry-run"], capture_output=True, text=True,
                          env=env_for_tests(), timeout=120)
    assert plan.returncode == 0, plan.stderr[-2000:]
    planned = plan.stdout
    for row in cut + later:
        key = gpu_plan.row_key(row["label"], row["image"], row["batch"])
        assert key in planned, (key, planned)


def test_gpu_check_starts_no_row_once_stopped_and_its_forked_helpers_just_exit():
    """A stop before the lanes start (during the plan or the imports' aftermath) leaves every
    row not started; a process forked from the run (the tree's worker pool) that gets the
    stop exits at once instead of acting as the run (it would never end its pool's join)."""
    import multiprocessing
    rows = _small_plan()
    lanes.STOP.set()
    try:
        left = lanes.run_lanes(rows, 2, time.monotonic() + 60, lambda row: 1,
                               lambda row: pytest.fail("a row started after the stop"),
                               lambda row, result: None)
    finally:
        lanes.STOP.clear()
    assert left == rows
    child = multiprocessing.get_context("fork").Process(
        target=lanes.stop_rows, args=(signal.SIGTERM, None))
    child.start()
    child.join(30)
    assert child.exitcode == 128 + signal.SIGTERM
    assert not lanes.STOP.is_set() and not lanes.CAUGHT


def test_gpu_check_compile_group_runs_the_targets_size_first(gpu_check):
    """--rows compile does not fit one allocation by its guesses: the 224 px rows (eager,
    --cuda-graph, every --compile mode: what the 224 px target compares) come first, so a run
    cut by --minutes has that size whole before any 64 px row, and --continue the rest."""
    rows = gpu_plan.plan("compile", gpu=True)
    images = [row.image for row in rows]
    assert images == sorted(images, reverse=True) and images.count(224) == images.count(64)
    first = rows[:images.count(224)]
    assert {gpu_plan.CEILING, gpu_plan.GRAPH} | {
        gpu_plan.compiled_label(mode) for mode in gpu_check.flags.COMPILE_MODES} == {
        row.label for row in first}
    runs, left = lanes.simulate_lanes(rows, 1, 60 * 8, lambda row: row.need_s)
    assert all(row.image == 224 for _, row, *_ in runs), runs  # 8 minutes: 224 px rows only


HANGING_ROW = """
import subprocess, sys, time, traceback
sys.path.insert(0, {repo!r})
from training import hangs
hangs.print_stacks_on_signal()
child = subprocess.Popen(["sleep", "120"])  # a logger beside it: no handler for the signal
try:
    raise RuntimeError("handled")
except RuntimeError:
    traceback.print_exc()  # a traceback earlier in its stderr: no process of the dump
print(f"started {{child.pid}}", flush=True)

def waits_here():
    time.sleep(120)

waits_here()
"""


def test_gpu_check_says_where_a_row_was_when_its_timeout_ended_it(tmp_path):
    """A row that outlives its timeout: its training process prints its Python stacks before
    it is killed with every process of the row, and the row's note says the last line it
    printed and where it waited."""
    script = tmp_path / "row.py"
    script.write_text(HANGING_ROW.format(repo=str(REPO)))
    t0 = time.monotonic()
    with pytest.raises(process_tree.RowTimeout) as late:
        process_tree.run_command([sys.executable, str(script)], 5, env_for_tests())
    assert time.monotonic() - t0 < 20
    said = re.fullmatch(r"no result within 5 s \(its last line: started (\d+)\)", str(late.value))
    assert said, str(late.value)
    stack = late.value.stack
    assert stack[0] == "process 1 of 1, innermost first:", stack
    assert "in waits_here" in stack[1] and stack[-1].endswith(" in <module>"), stack
    for _ in range(50):  # gone, or a zombie its new parent has not reaped (a moment to exit)
        if process_tree.exited(int(said.group(1))):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the row's child outlived its timeout")
    result = late.value.result(["row"])
    text = gpu_report.report([{"label": "a row", "batch": 8, "image": 64, "kind": "train",
                              "timed": False, **result}], [], False, 2, [])
    assert "a row: where it was at the timeout:" in text
    assert "in waits_here" in text


def test_gpu_check_ends_a_cache_build_that_outlives_its_timeout(tmp_path, monkeypatch):
    """The data row's cache build ran without a timeout: one that hung held its lane, and the
    whole run, until the allocation ended."""
    (tmp_path / "ddp_train.py").write_text("import time\ntime.sleep(300)\n")
    monkeypatch.setattr(gpu_rows, "REPO", tmp_path)
    monkeypatch.setattr(gpu_rows, "CACHE_BUILD_S", 3)
    t0 = time.monotonic()
    said = gpu_rows.prepare_data(tmp_path / "tree", {"cache": str(tmp_path / "cache")},
                                 gpu=False, given=True, timeout=3)
    assert said.startswith("building the cache: no result within 3 s"), said
    assert time.monotonic() - t0 < 30


def test_gpu_check_makes_its_data_with_the_rows_share_of_the_cores(gpu_check, tmp_path,
                                                                  monkeypatch):
    """The tree's writers and the cache's decoders: the data job's share of the host's cores
    (the cores over the rows at once), not every core beside the timed rows of the other
    lanes; whatever OMP_NUM_THREADS a user set (1 on many clusters, or a list such as 8,1)."""
    made, commands = [], []
    monkeypatch.setattr(gpu_rows, "make_tree_parallel",
                        lambda root, *sizes, workers: made.append((sizes, workers)))
    monkeypatch.setattr(gpu_rows, "run_command", lambda cmd, timeout: commands.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    assert gpu_rows.prepare_data(tmp_path / "tree", {"cache": str(tmp_path / "cache")},
                                 gpu=True, given=False, timeout=60, cores=4) is None
    assert made == [((200, 500, 50), 4)] and commands[0][-2:] == ["--num-workers", "4"]
    gpu_rows.prepare_data(tmp_path / "tree", {"cache": str(tmp_path / "cache")}, gpu=True,
                          given=False, timeout=60)  # 0: every core, and the script's default
    assert made[1][1] == 0 and "--num-workers" not in commands[1]
    # the share gpu_check gives it: the timed rows one after another, and beside them two
    # untimed rows and the data job: 4 rows at once on 16 cores, 4 each
    seen = []
    plan = _small_plan() + [gpu_plan.Row("ddp, cache", 8, args=["--data-on-device"],
                                         needs_data=True, timed=False)]
    monkeypatch.setattr(gpu_check, "plan", lambda which, gpu: plan)
    monkeypatch.setattr(gpu_rows, "run_training", lambda row, *a, **k: _fake_training(row, *a))
    monkeypatch.setattr(gpu_check.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(gpu_check, "prepare_data", lambda *a: seen.append(a[-1]))
    monkeypatch.setenv("OMP_NUM_THREADS", "8,1")  # the user's, for the rows: not the data's
    gpu_check.main(["--out", str(tmp_path / "r.md"), "--lanes", "4"])
    assert seen == [4]


def test_gpu_check_launcher_row_whose_summary_outlives_it_times_out(tmp_path, monkeypatch):
    """analyze_memory.py --plot at the row's timeout: the row's "timed out" result, which
    --continue runs again, not a TimeoutExpired the lane reported as a crash of gpu_check."""
    def run(cmd, timeout, env=None):
        if "local.sh" in cmd[1]:  # the training ran and wrote its run directory
            (tmp_path / "launcher-runs" / "gpu-check-1").mkdir(parents=True)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        raise process_tree.RowTimeout(timeout, "reading the logs", [])
    monkeypatch.setattr(gpu_rows, "run_command", run)
    row = gpu_plan.Row("launchers", 16, kind="launcher")
    result = gpu_rows.run_launcher(row, "cnn", 2, tmp_path, None, timeout=20)
    assert result["error"].startswith(process_tree.TIMED_OUT), result
    assert "analyze_memory.py" in result["cmd"][1]


HANGING_TEST = """
import pathlib, subprocess, sys, time

def test_starts_a_run_and_waits():
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                           start_new_session=True)  # as torchrun's workers are
    pathlib.Path({pid_file!r}).write_text(str(run.pid))
    time.sleep(300)
"""


def test_gpu_check_ends_the_runs_of_equivalence_tests_that_outlive_their_timeout(tmp_path):
    """The equivalence tests' row at its timeout ended pytest alone: the training runs the
    tests had started went on, on the GPU beside the next rows (the timed ones among them)."""
    pid_file = tmp_path / "pid"
    (tmp_path / "test_hangs_here.py").write_text(HANGING_TEST.format(pid_file=str(pid_file)))
    passed, summary, failed, _ = gpu_rows._pytest([str(tmp_path / "test_hangs_here.py")],
                                                  env_for_tests(), 8)
    assert passed is False and summary.startswith("no result within 8 s"), summary
    assert pid_file.exists(), "the test did not start its run"
    for _ in range(50):
        if process_tree.exited(int(pid_file.read_text())):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the test's run outlived the row's timeout")


DEEP_DUMP = """
import faulthandler, traceback
try:
    raise RuntimeError("an earlier error")
except RuntimeError:
    traceback.print_exc()

def deeper(n):
    if n:
        return deeper(n - 1)
    faulthandler.dump_traceback(all_threads=True)

deeper(120)
"""


def test_gpu_check_finds_a_main_thread_that_faulthandler_cut_short(tmp_path):
    """faulthandler keeps 100 frames of a thread and marks the cut with "...": a main thread
    deeper than that (a --compile row's) is still found, and a traceback printed before the
    dump is not taken for a process."""
    script = tmp_path / "deep.py"
    script.write_text(DEEP_DUMP)
    dump = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60).stderr
    assert "RuntimeError: an earlier error" in dump and "\n  ...\n" in dump, dump[-2000:]
    stack = process_tree.stacks_at_timeout(dump)
    assert stack[0] == "process 1 of 1, innermost first:", stack
    assert all(line.endswith(" in deeper") for line in stack[1:5]), stack
    assert stack[5:] == ["  ..."], stack


def test_a_training_row_at_its_timeout_says_where_the_training_process_was():
    """A real training run at gpu_check's timeout: ddp_train.py prints where it is (a frame of
    the toolkit among its main thread's), so a row that never ends says what it waited for."""
    cmd = [sys.executable, str(REPO / "ddp_train.py"), "--model", "resnet18",
           "--synthetic-size", "4096", "--batch-size", "16", "--epochs", "1000",
           "--log-every", "1"]
    with pytest.raises(process_tree.RowTimeout) as late:
        process_tree.run_command(cmd, 15, env_for_tests())  # its start takes about 5 s
    assert re.match(r"no result within 15 s \(its last line: .*\)$", str(late.value))
    stack = late.value.stack
    assert stack and stack[0].startswith("process 1 of "), stack
    first = stack[1:next((i for i, line in enumerate(stack) if i and line.startswith("process")),
                         len(stack))]
    # the training process first, not one of its DataLoader workers, down to the toolkit's
    # lines: the script's, or, where the main thread waits deeper in the toolkit (a batch from
    # a worker), the innermost of training/'s
    ours = re.compile(rf'File "{re.escape(str(REPO))}/(ddp_train\.py|training/\w+\.py)", line')
    assert any(ours.search(line) for line in first), stack
    assert not any("_worker_loop" in line for line in first), stack


def test_exited_tells_a_zombie_from_a_process_whose_main_thread_ended():
    """Both read "Z" in /proc; only the first has ended: the other's threads still run."""
    code = ("import threading, time, ctypes\n"
            "threading.Thread(target=time.sleep, args=(30,)).start()\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")  # the main thread ends, the other runs
    proc = subprocess.Popen([sys.executable, "-c", code])
    stat = Path(f"/proc/{proc.pid}/stat")
    try:
        deadline = time.monotonic() + 30
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the main thread never ended"
            time.sleep(0.1)
        assert not process_tree.exited(proc.pid)
        proc.kill()  # a zombie once its threads are gone, not reaped yet
        deadline = time.monotonic() + 30
        while not process_tree.exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_tree.exited(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert process_tree.exited(proc.pid)


def test_a_row_started_as_the_run_stops_is_ended_at_once():
    """A row whose process started just after the stop ended the running ones (a start the
    stop's sweep could not see) ran to its end and kept the stopped run waiting: such a
    process is ended as soon as it has started."""
    lanes.STOP.set()
    try:
        t0 = time.monotonic()
        proc = process_tree.run_command(["sleep", "30"], 60)
    finally:
        lanes.STOP.clear()
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 10
