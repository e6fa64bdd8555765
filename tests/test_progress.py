"""A run explains itself while it runs: a progress line at a steady cadence with an ETA that
holds, and the share of the training time spent waiting for the data loader."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ON_CUDA, REPO, check_ok, env_for_tests, metrics, run_script


from training import contract, measure, profiling, schedule
from training.faults import UsageError

PATCHED = REPO / "tests" / "patched_run.py"
PROGRESS_RE = re.compile(
    r"^progress: epoch (\d+)/(\d+), step (\d+)/(\d+) \| ([\d.]+) img/s \| elapsed ([\d:]+) \| "
    r"ETA epoch ([\d:]+), run ([\d:]+)( \+ evaluation)?$", re.M)
# The CNN on synthetic data whose every sample takes 5 ms to make: about 80 ms a step
SLOW = ["--model", "cnn", "--synthetic-size", "512", "--batch-size", "16", "--epochs", "3",
        "--num-workers", "0", "--amp", "off"]


def seconds(clock: str) -> int:
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return total


def run_slow(tmp_path, *args, sample_s: float = 0.005) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(PATCHED), "slow_loader", str(tmp_path), "ddp_train.py",
           *SLOW, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env_for_tests({"SLOW_SAMPLE_S": str(sample_s)}))


def test_progress_lines_come_at_their_cadence_with_an_eta_that_holds(tmp_path):
    proc = run_slow(tmp_path, "--log-every", "1")
    check_ok(proc)
    lines = PROGRESS_RE.findall(proc.stdout)
    total = float(metrics(proc.stdout)[-1]["total_time_s"])
    # the first line after the first three steps, then about one a second
    assert lines[0][:4] == ("1", "3", "3", "32")
    assert total / 2 <= len(lines) <= total + 3 * 2, (total, len(lines))
    for epoch, epochs, step, steps, rate, *_ in lines:
        assert epochs == "3" and steps == "32" and 1 <= int(step) < 32 and float(rate) > 0
    # every line's ETA for the run, against what the run then really took (a generous factor)
    for *_, elapsed, eta_epoch, eta_run, plus_eval in lines:
        remaining = total - seconds(elapsed)
        if remaining > 3:  # too close to the end, whole seconds say little
            assert remaining / 3 <= seconds(eta_run) + 1 <= remaining * 3, (eta_run, remaining)
        assert seconds(eta_epoch) <= seconds(eta_run)
    assert [p for *_, p in lines if p] and not lines[-1][-1]  # "+ evaluation": epoch 1 only
    # rank 0 only, and the epoch lines are where they were
    assert all(line.startswith("progress: ") for line in proc.stdout.splitlines()
               if "progress" in line)


def test_data_wait_is_the_share_of_time_spent_waiting_for_the_loader(tmp_path):
    # the same model on data held on the device, next to no waiting: run beside the slow one,
    # which mostly sleeps
    with ThreadPoolExecutor(1) as pool:
        on_device = pool.submit(run_script, "ddp_train.py", [
            "--model", "cnn", "--synthetic-size", "512", "--batch-size", "16", "--epochs", "2",
            "--amp", "off", "--data-on-device"])
        # 20 ms a sample, 0.3 s a batch: several times what the step takes (2 epochs of 8)
        slow = run_slow(tmp_path, "--log-every", "0", "--synthetic-size", "128", "--epochs",
                        "2", sample_s=0.02)
        fast = on_device.result()
    check_ok(slow)
    assert "progress:" not in slow.stdout  # --log-every 0: none
    waits = [float(m["data_wait_frac"]) for m in metrics(slow.stdout)]
    assert len(waits) == 3 and min(waits) > 0.5, waits
    assert re.search(r"\| Data wait: [5-9]\d% \|", slow.stdout, re.M)
    check_ok(fast)
    waits = [float(m["data_wait_frac"]) for m in metrics(fast.stdout)]
    assert waits and max(waits) < 0.2, waits


def test_progress_wording():
    assert measure._clock(0) == "0:00" and measure._clock(69.9) == "1:09"
    assert measure._clock(3 * 3600 + 5 * 60 + 9) == "3:05:09"
    assert "data_wait_frac" in contract.METRIC_KEYS


def test_the_epoch_line_shows_a_learning_rate_six_decimals_cannot():
    """--lr 1e-7, or a warm-up's first epochs, read "LR: 0.000000"; --lr 1e30 a 40-digit one."""
    figures = dict(epoch=1, epochs=2, train_loss=1.0, val_loss=1.0, train_acc=50.0,
                   val_acc=50.0, throughput_img_s=10.0, data_wait_frac=0.1, image_size=32)
    shown = [re.search(r"LR: (\S+) ", contract.format_epoch_line(figures | {"lr": lr}))[1]
             for lr in (0.01, 0.1, 1e-4, 1e-7, 1e30)]
    assert shown == ["0.010000", "0.100000", "0.000100", "1.000e-07", "1.000e+30"]


def test_linear_lr_scaling_with_warm_up_gives_the_documented_rate_at_every_step(tmp_path):
    """--lr-scaling linear: peak = --lr x global batch / --base-batch; over --warmup-epochs the
    rate at step s (0-based) is peak x (s + 1) / warm-up steps; then x --gamma every
    --step-size epochs. Recorded from inside a real 2-process run, at every optimizer step."""
    args = ["--model", "cnn", "--synthetic-size", "256", "--batch-size", "16", "--epochs", "3",
            "--num-workers", "0", "--amp", "off", "--lr", "0.01", "--lr-scaling", "linear",
            "--base-batch", "16", "--warmup-epochs", "1.5", "--step-size", "2",
            "--log-every", "0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(PATCHED), "record_lr", str(tmp_path), "ddp_train.py", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env_for_tests())
    check_ok(proc)
    peak, steps, warmup = 0.01 * 32 / 16, 256 // 32, 12  # 8 steps an epoch; 1.5 x 8
    expected = [peak * min(1.0, (s + 1) / warmup) * 0.1 ** (s // steps // 2)
                for s in range(3 * steps)]
    for rank in (0, 1):
        got = [float(x) for x in (tmp_path / f"lr-rank{rank}.txt").read_text().split()]
        assert len(got) == len(expected)
        assert all(abs(g - e) < 1e-12 for g, e in zip(got, expected)), (got, expected)
    m = metrics(proc.stdout)
    assert [x["lr_peak"] for x in m] == ["0.02"] * 4
    assert {x["lr_scaling"] for x in m} == {"linear"} and {x["warmup_epochs"] for x in m} == {
        "1.5"}
    for logged, want in zip([float(x["lr"]) for x in m[:3]], [expected[0], expected[8],
                                                              expected[16]]):
        assert abs(logged - want) <= 1e-6 * want  # the line keeps 7 significant digits


def test_lr_scaling_rules():
    import argparse
    args = argparse.Namespace(lr=0.1, base_batch=256, lr_scaling="linear", warmup_epochs=0,
                              step_size=30, gamma=0.1, epochs=90)
    assert schedule.peak_lr(args, 8192) == 0.1 * 32  # Goyal et al.: 8k batch, 3.2
    args.lr_scaling = "sqrt"
    assert abs(schedule.peak_lr(args, 1024) - 0.2) < 1e-12
    args.lr_scaling = "none"
    assert schedule.peak_lr(args, 8192) == 0.1
    factor = schedule.lr_factor(args, steps=100)
    assert factor(0) == 1.0 and abs(factor(3000) - 0.1) < 1e-12
    args.warmup_epochs = 0.25  # 25 steps
    factor = schedule.lr_factor(args, steps=100)
    assert [factor(s) for s in (0, 11, 24, 25)] == [1 / 25, 12 / 25, 1.0, 1.0]
    # scaled past what the optimizer's float32 holds: refused, not a traceback in the first step
    args.lr, args.lr_scaling = 1e38, "linear"
    with pytest.raises(UsageError, match=r"--lr 1e\+38 scaled by --lr-scaling linear to the "
                       r"global batch of 2048 \(8e\+38\) must be below the largest float32"):
        schedule.peak_lr(args, 2048)
    args.lr, args.gamma, args.step_size = 1e35, 10.0, 1  # grows past it at the 3rd of 90 decays
    with pytest.raises(UsageError, match=r"times --gamma 10 at each of the 90 decays"):
        schedule.peak_lr(args, 2048)


def test_check_measures_bandwidth_the_way_nccl_tests_do(check_runs):
    """fsdp --check: all-gather, reduce-scatter and all-reduce at four sizes up to the model's
    gradient size; algbw = bytes / time, busbw = algbw x 2(n-1)/n (all-reduce) or (n-1)/n."""
    from training import models
    proc = check_runs["fsdp_train.py"]
    check_ok(proc)
    lines = [dict(kv.split("=") for kv in line.split()[1:]) for line in proc.stdout.splitlines()
             if line.startswith(contract.BANDWIDTH_PREFIX + " ")]
    assert [x["op"] for x in lines] == ["all_gather"] * 4 + ["reduce_scatter"] * 4 + [
        "all_reduce"] * 4
    grad = sum(p.numel() * 4 for p in models.build_model("cnn", 10, (3, 32, 32)).parameters())
    sizes = [int(x["bytes"]) for x in lines[:4]]
    assert sizes == sorted(sizes) and sizes[-1] == grad // 8 * 8 and sizes[0] >= grad // 64 - 8
    for x in lines:
        algbw = int(x["bytes"]) / (float(x["time_ms"]) / 1e3) / 1e9
        assert abs(algbw - float(x["algbw_gbs"])) <= 0.01 * algbw + 0.001
        factor = 1.0 if x["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n at n = 2
        assert abs(float(x["busbw_gbs"]) - float(x["algbw_gbs"]) * factor) <= 0.0015
    # DDP measures the all-reduce it uses; one process has nothing to measure
    ddp = check_runs["ddp_train.py"]
    check_ok(ddp)
    assert ddp.stdout.count("[BANDWIDTH] op=all_reduce ") == 4
    # beside the figures, the network that carried them: gloo's TCP and its interface on the
    # CPU (training/network.py), NCCL's transport from its captured INFO lines on GPUs
    transports = {kv for line in ddp.stdout.splitlines() if line.startswith("[BANDWIDTH] ")
                  for kv in line.split() if kv.startswith("transport=")}
    assert len(transports) == 1 and transports != {"transport=unknown"}
    if not ON_CUDA:
        assert transports.pop().startswith("transport=gloo-tcp")
    single = run_script("ddp_train.py", ["--check", "--model", "cnn"])
    check_ok(single)
    assert "[BANDWIDTH]" not in single.stdout and "no bandwidth to measure" in single.stdout


def _x(name, start, end, cat="cpu_op"):
    return {"ph": "X", "name": name, "cat": cat, "ts": start, "dur": end - start}


def test_step_breakdown_splits_the_step_into_parts_that_do_not_overlap():
    # A GPU trace (microseconds): compute kernels 0-100 and 150-300, an NCCL all-reduce
    # 80-200 (hidden behind compute but for 100-150), the host waiting for data 300-350 and
    # 120-140 (the latter while the GPU worked: not a stall). 2 steps in 500 us. On the host,
    # the launch of the all-reduce (nccl:all_reduce) and the stop vote on a gloo group, which
    # is open until every rank has voted: neither is GPU communication.
    gpu = {"traceEvents": [
        _x("nccl:all_reduce", 70, 80), _x("gloo:all_reduce", 100, 420, "user_annotation"),
        _x("sgemm", 0, 100, "kernel"), _x("conv", 150, 300, "gpu_memcpy"),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 80, 200, "kernel"),
        _x(profiling.WAIT_LABEL, 300, 350, "user_annotation"),
        _x(profiling.WAIT_LABEL, 120, 140, "user_annotation"),
        _x("aten::addmm", 0, 400), {"ph": "i", "name": "marker", "ts": 5},
        # the host's launches: 3 kernels, a copy, a graph (2 steps: 2.5 a step); a sync is not one
        _x("cudaLaunchKernel", 1, 2, "cuda_runtime"),
        _x("cudaLaunchKernelExC", 3, 4, "cuda_runtime"),
        _x("cuLaunchKernel", 5, 6, "cuda_driver"), _x("cudaMemcpyAsync", 7, 8, "cuda_runtime"),
        _x("cudaGraphLaunch", 9, 10, "cuda_runtime"),
        _x("cudaStreamSynchronize", 11, 12, "cuda_runtime")]}
    parts = profiling.step_breakdown(gpu, steps=2, window_s=500e-6, gpu=True)
    assert parts == pytest.approx(dict(steps=2, step_ms=0.25, compute_ms=0.125,
                                       exposed_comm_ms=0.025, data_wait_ms=0.025,
                                       other_ms=0.075, comm_ms=0.06, launches_per_step=2.5))
    # A CPU trace: the training thread's operators 0-100, a gloo all-reduce on its own thread
    # 90-220, a wait for data 200-250 with the loader's own operator inside (not compute),
    # the c10d launch (not compute). 1 step in 300 us.
    cpu = {"traceEvents": [
        _x("aten::convolution", 0, 100), _x("aten::convolution", 30, 60),
        _x("gloo:all_reduce", 90, 220, "user_annotation"), _x("c10d::allreduce_", 95, 96),
        _x(profiling.WAIT_LABEL, 200, 250, "user_annotation"), _x("aten::stack", 210, 240)]}
    parts = profiling.step_breakdown(cpu, steps=1, window_s=300e-6, gpu=False)
    assert parts == pytest.approx(dict(steps=1, step_ms=0.3, compute_ms=0.1,
                                       exposed_comm_ms=0.1, data_wait_ms=0.05, other_ms=0.05,
                                       comm_ms=0.13, launches_per_step=0))


def test_profile_writes_a_trace_and_a_step_breakdown_that_adds_up(tmp_path):
    """--profile on CPU with gloo, for each strategy: the trace loads as JSON, and the
    [PROFILE] line's parts add up to the step time."""
    import json
    for script, nproc in (("ddp_train.py", 2), ("fsdp_train.py", 2), ("dp_train.py", None)):
        out = tmp_path / script
        proc = run_script(script, ["--model", "cnn", "--synthetic-size", "256",
                                   "--batch-size", "16", "--epochs", "1", "--amp", "off",
                                   "--profile", str(out)], nproc=nproc)
        check_ok(proc)
        lines = [line for line in proc.stdout.splitlines()
                 if line.startswith(contract.PROFILE_PREFIX + " ")]
        assert len(lines) == 1, proc.stdout  # rank 0, once
        fields = dict(kv.split("=", 1) for kv in lines[0].split()[1:])
        assert fields["trace"] == str(out / "profile_trace_rank0.json")
        trace = json.loads((out / "profile_trace_rank0.json").read_text())
        assert any(e.get("name") == profiling.WAIT_LABEL for e in trace["traceEvents"])
        step, parts = float(fields["step_ms"]), [float(fields[k]) for k in (
            "compute_ms", "exposed_comm_ms", "data_wait_ms", "other_ms")]
        assert fields["steps"] == "5" and step > 0 and min(parts) >= 0
        assert abs(sum(parts) - step) <= 0.02 * step, (parts, step)
        assert parts[0] > 0.3 * step  # a CPU step is mostly compute
        assert (float(fields["comm_ms"]) > 0) == (nproc == 2)  # dp: no process group
        # the sentence after it: how much of the communication compute hid, or that there is
        # none (never "0 ms, 100% of it hidden")
        said = re.search(r"^profile: [\d.]+ ms per step = .*\((.*)\); open ", proc.stdout, re.M)
        assert said, proc.stdout
        assert re.fullmatch(r"communication [\d.]+ ms, \d+% of it hidden behind compute"
                            if nproc == 2 else r"no communication", said.group(1)), said.group(1)
        # the bandwidth the collectives get, at the gradient size: collect_results' model
        assert (f"{contract.BANDWIDTH_PREFIX} op=all_reduce " in proc.stdout) == (nproc == 2)
        # with the collectives per step, for the model's latency term: the CNN's gradients fit
        # one DDP bucket; FSDP gathers each unit twice (full) and reduce-scatters it once
        counts = dict(re.findall(r"op=(\w+) .* messages=(\d+)$", proc.stdout, re.M))
        if script == "ddp_train.py":
            assert counts == {"all_reduce": "1"}, proc.stdout
        elif script == "fsdp_train.py":
            units = int(counts["reduce_scatter"])
            assert units > 1 and counts == {"all_gather": str(2 * units),
                                            "reduce_scatter": str(units)}, proc.stdout
        assert "ms per step = compute" in proc.stdout


def test_profile_of_a_short_epoch_says_it_traced_fewer_steps(tmp_path):
    proc = run_script("ddp_train.py", ["--model", "cnn", "--synthetic-size", "256",
                                       "--batch-size", "16", "--epochs", "1", "--amp", "off",
                                       "--max-steps-per-epoch", "3", "--profile", str(tmp_path)])
    check_ok(proc)
    assert ("note: --profile: this epoch runs 3 step(s), so it traces 2 after 1 warm-up "
            "step(s), not 5 after 3" in proc.stdout)
    assert f"{contract.PROFILE_PREFIX} steps=2 " in proc.stdout


@pytest.mark.parametrize("steps, window, note", [
    (8, (3, 8), False),  # 3 + 5 fit: it said "traces 5 after 2 warm-up step(s), not 5 after 3"
    (7, (2, 7), True), (3, (1, 3), True), (100, (3, 8), False)])
def test_the_profile_window_keeps_its_warm_up_where_the_epoch_has_room(capsys, steps, window,
                                                                       note):
    import torch
    profiler = profiling.StepProfiler(None, False, steps, torch.device("cpu"))
    profiler.out_dir = "unused"  # a window, without a process group
    assert profiler._window(0) == window
    assert ("note: --profile" in capsys.readouterr().out) == note


def test_profile_needs_a_writable_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_script("ddp_train.py", ["--profile", str(blocker / "sub")])
    assert proc.returncode == 2 and "--profile" in proc.stderr and "Traceback" not in proc.stderr


def test_first_progress_line_comes_within_seconds_when_steps_are_slow(monkeypatch, capsys):
    """6 s a step (ResNet-50 on a 2-core CPU): the first line comes at the first step boundary
    10 s into the epoch (after 2 steps), not after 3 steps (18 s); then every --log-every."""
    clock = [1000.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    meter = measure.StepMeter(every=30, epochs=1, steps=20, images_per_step=128)
    for _ in meter.epoch(range(20), epoch=0, start_step=0):
        clock[0] += 6.0  # the step
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("progress")]
    steps = [int(PROGRESS_RE.match(line).group(3)) for line in lines]
    assert steps == [2, 7, 12, 17], lines  # at 12 s, then at 42, 72 and 102 s
    assert lines[0].endswith("| 21.3 img/s | elapsed 0:12 | ETA epoch 1:48, run 1:48 + evaluation")


def test_step_meter_counts_the_loaders_wait_as_its_data_wait(monkeypatch):
    """StepMeter.data_wait_s is the host's wait for each next batch, never the step's own
    time, and starts again at 0 each epoch (the [RANKS] line's data_wait_s, data_wait_frac)."""
    clock = [1000.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])

    def loader(n):  # 0.5 s to make each batch
        for i in range(n):
            clock[0] += 0.5
            yield i
    meter = measure.StepMeter(every=0, epochs=2, steps=4, images_per_step=8)
    for _ in meter.epoch(loader(4), epoch=0, start_step=0):
        clock[0] += 6.0  # the step
    assert meter.data_wait_s == pytest.approx(2.0)
    for _ in meter.epoch(loader(2), epoch=1, start_step=2):
        clock[0] += 6.0
    assert meter.data_wait_s == pytest.approx(1.0)


def test_profile_tears_cupti_down_after_its_window(tmp_path, monkeypatch):
    """Kineto leaves CUPTI hooked into every CUDA call after the profiler stops unless
    TEARDOWN_CUPTI=1 is in the environment as it stops: with --profile it is, from the
    profiler's making on (rank 0, the one that traces), and a value the user set is kept."""
    import os
    import torch
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    profiling.StepProfiler(None, False, 10, torch.device("cpu"))
    assert "TEARDOWN_CUPTI" not in os.environ  # without --profile: no profiler, nothing set
    at_stop, stop = [], torch.profiler.profile.stop

    def record(self):
        at_stop.append(os.environ.get("TEARDOWN_CUPTI"))
        stop(self)
    monkeypatch.setattr(torch.profiler.profile, "stop", record)
    profiler = profiling.StepProfiler(str(tmp_path), False, 10, torch.device("cpu"))
    for _ in profiler.epoch(([torch.ones(64, 64) @ torch.ones(64, 64)] for _ in range(10)), 0):
        pass
    assert at_stop == ["1"]
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    profiling.StepProfiler(str(tmp_path), False, 10, torch.device("cpu"))
    assert os.environ["TEARDOWN_CUPTI"] == "0"


@pytest.mark.cuda_ok
def test_the_epoch_after_the_profiled_one_runs_at_the_speed_of_an_unprofiled_run(tmp_path):
    """On a GPU: --profile traces a window of epoch 1 and then tears CUPTI down, so epoch 2
    runs within 3% of the same epoch of a run without --profile (before, CUPTI stayed hooked
    into every launch: 43.6 ms a step against 31.7 in bench/gpu_check.py's rows). The CIFAR-10
    CNN at batch 256 is launch-bound, where CUPTI's cost shows most."""
    if not ON_CUDA:
        pytest.skip("needs a GPU (CUPTI's cost is per CUDA launch): run it with "
                    "DPT_TEST_DEVICE=cuda")
    args = ["--model", "cnn", "--synthetic-size", "131072", "--batch-size", "256", "--epochs",
            "2", "--num-workers", "0", "--data-on-device", "--device", "cuda"]
    plain = run_script("ddp_train.py", args)
    check_ok(plain)
    profiled = run_script("ddp_train.py", args + ["--profile", str(tmp_path)])
    check_ok(profiled)
    assert contract.PROFILE_PREFIX in profiled.stdout  # the window was traced, in epoch 1
    # [1]: epoch 2's [METRIC] line, the one after the profiled epoch
    speed = [float(metrics(run.stdout)[1]["throughput_img_s"]) for run in (plain, profiled)]
    assert speed[1] >= 0.97 * speed[0], f"epoch 2: {speed[1]:.0f} img/s after the profile, " \
                                        f"{speed[0]:.0f} without"
