"""The benchmark scripts run and print what bench/results/README.md quotes (tiny settings:
the figures themselves are measured by hand, not in the tests)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, env_for_tests


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


def test_train_throughput_prints_the_four_rows(tiny_imagenet, tmp_path):
    root, _ = tiny_imagenet
    out = run_bench("train_throughput.py", "--data-dir", str(root), "--model", "resnet18",
                    "--batch-size", "8", "--steps", "2", "--repeats", "1",
                    "--cache-dir", str(tmp_path / "c"))
    rows = re.findall(r"^\| (folder|cache|synthetic|plain)[^|]*\| ([\d.]+) \|", out, re.M)
    assert [r[0] for r in rows] == ["folder", "cache", "synthetic", "plain"], out
    assert all(float(r[1]) > 0 for r in rows)


def test_step_overhead_prints_three_variants():
    out = run_bench("step_overhead.py", "--model", "cnn", "--batch-size", "8", "--rounds", "2",
                    "--steps", "2")
    names = re.findall(r"^(bare|ddp|ddp\+metrics) +[\d.]+ ms/step +[+-][\d.]+%$", out, re.M)
    assert names == ["bare", "ddp", "ddp+metrics"], out


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
    assert re.search(r"^\| ddp, synthetic on device \| 64 \| 8 \| off \| .* \| 0 \| ", report,
                     re.M), "the profiled row counts the launches: none on a CPU"
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
    assert lines[0]["label"] == "ddp, synthetic on device" and lines[0]["img_s"] > 0


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
    assert "it needs about 45 s" in out and "FAILED" not in out


def test_gpu_check_names_the_equivalence_test_that_failed(monkeypatch):
    """The first GPU run said "1 failed, 2 passed" and nothing more: which test failed took a
    second run of the lease. The report now carries pytest's FAILED lines."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check
    out = ("..F\nFAILED tests/test_strategies.py::test_fsdp_ends_with_the_same_weights_as_ddp"
           "[full] - AssertionError: Tensor-likes are not close!\n1 failed, 2 passed in 55s\n")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, stdout=out, stderr=""))
    passed, text = gpu_check.equivalence_tests(1, 60)
    assert passed is False
    assert text.startswith("1 failed, 2 passed in 55s (1 process(es) per run, NCCL); FAILED "
                           "tests/test_strategies.py::test_fsdp_ends_with_the_same_weights_as_"
                           "ddp[full] - AssertionError")


def test_gpu_check_counts_the_recompilations_inside_the_timed_epoch():
    """--compile rows run with TORCH_LOGS=recompiles; only those inside the second epoch's
    training window (its [METRIC] clock times) count against the measurement."""
    import datetime
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check
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
    assert gpu_check.recompiles_between(log, start, start + 15) == 1
    assert gpu_check.recompiles_between("", start, start + 15) == 0


def test_compile_takes_a_mode():
    from training import flags
    import argparse
    parser = flags.add_common_args(argparse.ArgumentParser())
    assert parser.parse_args(["--compile"]).compile == "default"
    assert parser.parse_args(["--compile", "reduce-overhead"]).compile == "reduce-overhead"
    assert parser.parse_args([]).compile is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--compile", "fastest"])
