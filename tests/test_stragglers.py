"""Which rank holds the others back (training/stragglers.py): the analysis on made-up figures,
the [RANKS] line, the reports (results.md, the timeline, TensorBoard), and real 2- and 3-rank
runs on the CPU in which one rank is slowed from outside (paused with SIGSTOP for 80 ms of
every 100 ms, then resumed with SIGCONT) and must be named, while the same run unslowed names
nobody. The unslowed runs share the machine's cores with whatever else runs there: a rank the
scheduler starves is a real straggler, so on a busy machine they can name one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from training import contract, stragglers
from conftest import REPO, check_ok, env_for_tests, metrics, read_until, run_script

STRAGGLER_RE = re.compile(r"^straggler: epoch (\d+): (rank|device) (\d+) on (\S+) \((\S+)\) is "
                          r"(\d+)% slower than the (?:median|other) .* went to its (loader|own compute)",
                          re.M)
# enough steps per epoch that a 100 ms stop cycle is felt many times over
RUN = ["--model", "cnn", "--synthetic-size", "768", "--batch-size", "16", "--epochs", "2",
       "--num-workers", "0", "--amp", "off", "--device", "cpu", "--log-every", "0"]
# A slowed rank's run: 6 steps an epoch, each with more compute than communication, as a GPU
# step has. A rank paused inside a collective counts as waiting there, and on the CPU an FSDP
# step of batch 16 is mostly collectives: its pauses would hide in them.
SLOWED = ["--synthetic-size", "768", "--batch-size", "64"]


def rank(**kw) -> dict:
    return dict(dict(own_s=1.0, compute_s=0.9, data_wait_s=0.1, rank_wait_s=0.2, node="n0",
                     device="cpu"), **kw)


# --------------------------------------------------------------------------------------------
# The analysis
# --------------------------------------------------------------------------------------------

def test_balanced_ranks_name_nobody_but_report_the_spread():
    found = stragglers.analyse([rank(own_s=1.0), rank(own_s=1.05), rank(own_s=0.98)])
    assert found["straggler"] is None
    assert found["slowest_rank"] == 1
    assert found["rank_spread"] == pytest.approx(1.05)


def test_slow_compute_is_named_with_its_cause():
    ranks = [rank(), rank(own_s=1.5, compute_s=1.4, node="n1", device="cuda:1"), rank(),
             rank(own_s=1.02)]
    found = stragglers.analyse(ranks)
    s = found["straggler"]
    assert (found["slowest_rank"], s["rank"], s["cause"]) == (1, 1, "compute")
    assert found["rank_spread"] == pytest.approx(1.5 / 1.01)
    line = stragglers.straggler_line(3, found)
    assert STRAGGLER_RE.match(line).groups() == ("3", "rank", "1", "n1", "cuda:1", "49",
                                                 "own compute")


def test_slow_loader_is_named_as_data():
    ranks = [rank(), rank(own_s=1.4, compute_s=0.9, data_wait_s=0.5), rank()]
    s = stragglers.analyse(ranks)["straggler"]
    assert (s["rank"], s["cause"]) == (1, "data")
    assert "its loader (data wait)" in stragglers.straggler_line(1, stragglers.analyse(ranks))


def test_ten_percent_is_the_line():
    assert stragglers.analyse([rank(own_s=1.0), rank(own_s=1.099)])["straggler"] is None
    # two ranks: the median is their mean, so 1.0 vs 1.3 is 13% above it
    assert stragglers.analyse([rank(own_s=1.0), rank(own_s=1.3)])["straggler"]["rank"] == 1


def test_at_two_ranks_the_message_compares_with_the_other_rank():
    """It said "24% slower than the median" of a rank 63% slower than the other: the median of
    two is their mean."""
    line = stragglers.straggler_line(1, stragglers.analyse([rank(own_s=1.0), rank(own_s=1.63)]))
    assert "rank 1 on n0 (cpu) is 63% slower than the other rank (1.63 s of own time vs 1.00 s)" \
        in line
    three = stragglers.straggler_line(1, stragglers.analyse([rank(), rank(own_s=1.5), rank()]))
    assert "50% slower than the median rank (1.50 s of own time vs 1.00 s)" in three


def test_one_rank_is_never_a_straggler():
    found = stragglers.analyse([rank()])
    assert (found["slowest_rank"], found["rank_spread"], found["straggler"]) == (0, 1.0, None)


def test_ranks_line_round_trips_and_rejects_cut_lines():
    ranks = [rank(own_s=1.23456, node="gpu-node 1", device="cuda:0:NVIDIA H100"),
             rank(own_s=2.0, node="gpu-node2")]
    line = contract.format_ranks_line(4, ranks)
    assert line.startswith("[RANKS] epoch=4 own_s=1.235,2.000 ")
    epoch, back = contract.parse_ranks_line("rank0: " + line)
    assert epoch == "4" and [r["own_s"] for r in back] == [1.235, 2.0]
    assert back[0]["node"] == "gpu-node_1" and back[0]["device"] == "cuda:0:NVIDIA_H100"
    assert contract.parse_ranks_line(line.replace("own_s=1.235,2.000", "own_s=1.235")) is None
    assert contract.parse_ranks_line(line.rsplit(" ", 1)[0]) is None  # cut: no device=
    assert contract.parse_ranks_line("[METRIC] epoch=1") is None


def test_an_older_logs_ranks_line_reads_under_todays_names():
    """Logs written before the data wait and the rank wait were named apart say data_s= and
    wait_s=: the line still parses, into data_wait_s and rank_wait_s, and reads the same as
    today's line of the same figures."""
    old = ("[RANKS] epoch=2 own_s=0.735,2.695 compute_s=0.712,2.681 data_s=0.023,0.014 "
           "wait_s=2.849,0.797 node=gpu-node07,gpu-node07 device=cuda:0:H100,cuda:1:H100")
    epoch, ranks = contract.parse_ranks_line(old)
    assert epoch == "2"
    assert [(r["data_wait_s"], r["rank_wait_s"]) for r in ranks] == [(0.023, 2.849),
                                                                     (0.014, 0.797)]
    assert "data_s" not in ranks[0] and "wait_s" not in ranks[0]
    today = contract.format_ranks_line(2, ranks)
    assert " data_wait_s=0.023,0.014 rank_wait_s=2.849,0.797 " in today
    assert contract.parse_ranks_line(today) == (epoch, ranks)


def test_metric_line_without_the_spread_still_formats_as_nan(capsys):
    """A checkpoint written before slowest_rank existed resumes and prints its final line; a
    training epoch without the keys is a bug the writer refuses."""
    from training import measure
    m = {k: 1 for k in contract.METRIC_KEYS if k not in ("slowest_rank", "rank_spread")}
    with pytest.raises(KeyError, match="slowest_rank"):
        contract.format_metric_line(m)
    measure.print_final(m, 12.0, trained=True, run=m)
    assert "slowest_rank=nan rank_spread=nan final=1 total_time_s=12" in capsys.readouterr().out


def test_unmeasured_waits_name_nobody_and_say_nan():
    """--cuda-graph's replay runs no hooks: with no wait measured every rank's time is the
    same, so the keys are nan (not a balanced 1.0) and no line is printed."""
    clock = stragglers.RankClock(torch.device("cpu"), measured=False)
    found = clock.end_epoch(1, train_time=2.0, data_wait=0.1)
    assert set(found) == {"slowest_rank", "rank_spread"}
    assert all(v != v for v in found.values())  # nan
    assert clock.lines == []


def test_host_spans_add_up_and_reset():
    spans = stragglers.Spans(torch.device("cpu"))
    spans.open()
    time.sleep(0.02)
    spans.close()
    spans.close()  # nothing open: nothing added
    assert 0.015 < spans.seconds() < 0.5
    spans.reset()
    assert spans.seconds() == 0.0


def test_dataparallel_devices_are_its_ranks(monkeypatch):
    """DataParallel's per-device path, without GPUs: each device's compute (the spans its
    hooks time) against the one process's training time and data wait."""
    clocks = stragglers.DeviceClocks(torch.nn.Linear(2, 2), [torch.device("cpu")])
    assert clocks.figures(2.0, 0.5) == [dict(own_s=2.0, compute_s=1.5, data_wait_s=0.5,
                                             rank_wait_s=0.0, node=clocks.node, device="cpu")]

    class Fixed:  # a device's spans, as CUDA events would sum them
        def __init__(self, s):
            self.s = s

        def seconds(self):
            return self.s

    monkeypatch.setattr(stragglers, "device_name", lambda d: f"cuda:{d.index}")
    clocks.compute = {torch.device("cuda", i): Fixed(s) for i, s in enumerate((1.0, 1.6, 1.05))}
    ranks = clocks.figures(2.0, 0.2)
    assert [r["rank_wait_s"] for r in ranks] == pytest.approx([0.8, 0.2, 0.75])
    found = stragglers.analyse(ranks)
    assert found["straggler"]["rank"] == 1 and found["straggler"]["device"] == "cuda:1"
    assert "device 1 on" in stragglers.straggler_line(1, found, clocks.what)


def test_dataparallel_hooks_time_each_replicas_forward_and_backward():
    """The hooks DataParallel copies onto its replicas, on the CPU (host clocks stand in for a
    GPU's events): forward, then backward up to the first layer's gradient, on each replica's
    own device; a replica's parameters are the copies it computes with."""
    cpu = torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
    clocks = stragglers.DeviceClocks(model, [cpu])
    assert clocks.compute == {}  # one device: nothing to compare, no hooks
    spans, calls = stragglers.Spans(cpu), []
    for name in ("open", "close"):
        method = getattr(spans, name)
        setattr(spans, name, lambda method=method, name=name: (calls.append(name), method()))
    clocks.compute = {cpu: spans}
    clocks.watch(model)
    model(torch.randn(256, 64)).sum().backward()
    assert calls == ["open", "close", "open", "close"]  # forward, then backward
    assert spans.opened is None and spans.seconds() > 0
    forward_only = stragglers.Spans(cpu)
    clocks.compute = {cpu: forward_only}
    with torch.no_grad():
        model(torch.randn(256, 64))
    assert forward_only.opened is None and 0 < forward_only.seconds() < spans.seconds() * 2
    # a replica (DataParallel's copy) has empty _parameters and its copies elsewhere
    copy = torch.nn.Linear(2, 2)
    copy._former_parameters = dict(weight=torch.ones(2, 2, requires_grad=True))
    copy._parameters = {}
    assert [p.shape for p in stragglers._replica_parameters(copy)] == [(2, 2)]


# --------------------------------------------------------------------------------------------
# Real runs: one rank slowed from outside
# --------------------------------------------------------------------------------------------

def _descendants(pid: int) -> list:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            found.append(kid)
            todo.append(kid)
    return found


def _rank_pid(torchrun: int, rank: int) -> int | None:
    for pid in _descendants(torchrun):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def _slow_down(torchrun: subprocess.Popen, rank: int, done: threading.Event,
               stopped_s=0.08, every_s=0.1) -> None:
    """Pause ``rank`` (a child of torchrun) for stopped_s of every every_s until done."""
    pid = None
    while pid is None and not done.is_set():
        pid = _rank_pid(torchrun.pid, rank)
        time.sleep(0.05)
    while not done.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                return
        time.sleep(every_s - stopped_s)


def run_ranks(script: str, nproc: int, slow_rank: int | None = None, extra=()) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(REPO / script), *RUN, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_for_tests(), cwd=REPO)
    done = threading.Event()
    slower = threading.Thread(target=_slow_down, args=(proc, slow_rank, done), daemon=True) \
        if slow_rank is not None else None
    head = ""
    try:
        if slower:
            # Slowed from rank 0's "global batch" line on, when every rank has its process
            # group: a start-up (imports, rendezvous) at a fifth of its speed only made the
            # run longer, outside every epoch's figures.
            head = read_until(proc, "global batch:")
            slower.start()
        out, err = proc.communicate(timeout=120)
    finally:
        done.set()
        if slower and slower.is_alive():
            slower.join()
    check_ok(subprocess.CompletedProcess(cmd, proc.returncode, head + out, err))
    return head + out


def _last_epoch(out: str) -> tuple:
    """The last epoch's [METRIC] line and its per-rank figures."""
    last = [m for m in metrics(out) if "final" not in m][-1]
    ranks = [contract.parse_ranks_line(l) for l in out.splitlines() if l.startswith("[RANKS]")]
    return last, ranks[-1][1]


@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py"])
def test_a_slowed_rank_is_named(script):
    out = run_ranks(script, 2, slow_rank=1, extra=SLOWED)
    last, ranks = _last_epoch(out)
    named = STRAGGLER_RE.findall(out)
    assert named and named[-1][:3] == (last["epoch"], "rank", "1"), out
    assert named[-1][6] == "own compute"
    assert last["slowest_rank"] == "1" and float(last["rank_spread"]) > 1.2
    # the fast rank waited for it in the collectives; the slow one hardly did
    assert ranks[0]["rank_wait_s"] > ranks[1]["rank_wait_s"]


def _held_back_in_last_epoch(out: str) -> bool:
    """A straggler named, or a spread of 1.10 or more, in the last epoch: the first one's
    warm-up (lazy initialisation, the first steps) is not the same work on every rank."""
    last, _ = _last_epoch(out)
    named = [n for n in STRAGGLER_RE.findall(out) if n[0] == last["epoch"]]
    return bool(named) or float(last["rank_spread"]) >= 1.10


@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py"])
def test_an_unslowed_run_names_nobody(script, tmp_path):
    """A second run where the first was held back: an epoch here is about a second on two
    shared cores, and one scheduler stall of 0.2 s (a full suite run: rank 1's compute 1.09 s
    against 0.88 s) names a rank that nothing slowed. A false straggler the code makes is
    named in both runs."""
    board = tmp_path / "tb"
    out = run_ranks(script, 2, extra=["--tensorboard", str(board)])
    if _held_back_in_last_epoch(out):
        first = out
        shutil.rmtree(board)
        out = run_ranks(script, 2, extra=["--tensorboard", str(board)])
        assert not _held_back_in_last_epoch(out), f"first run:\n{first}\nsecond run:\n{out}"
    last, _ = _last_epoch(out)
    assert last["slowest_rank"] in ("0", "1") and float(last["rank_spread"]) < 1.10
    # TensorBoard gets the spread of every epoch, as the [METRIC] lines say it
    pytest.importorskip("tensorboard", reason="tensorboard is in requirements.txt")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(board))
    acc.Reload()
    assert [e.value for e in acc.Scalars("epoch/rank_spread")] == pytest.approx(
        [float(m["rank_spread"]) for m in metrics(out) if "final" not in m], rel=1e-6)


def test_three_ranks_figures_add_up_to_each_ranks_step_time():
    """compute + data + wait is each rank's training time; the slowest rank's is the epoch's."""
    out = run_ranks("ddp_train.py", 3)
    last, ranks = _last_epoch(out)
    assert len(ranks) == 3
    epoch_time = float(last["epoch_time_s"])
    for r in ranks:
        assert r["own_s"] == pytest.approx(r["compute_s"] + r["data_wait_s"], abs=2e-3)
        assert r["compute_s"] > 0 and r["rank_wait_s"] > 0
        assert r["own_s"] + r["rank_wait_s"] == pytest.approx(epoch_time, rel=0.05, abs=0.02)


# --------------------------------------------------------------------------------------------
# The reports: results.md's per-rank table, the scaling table's flag, the timeline, TensorBoard
# --------------------------------------------------------------------------------------------

def _metric(epoch: int, spread: float, slowest: int, **kw) -> dict:
    return dict(strategy="ddp", model="cnn", dataset="synthetic", device="cpu", world_size=2,
                nodes=1, gpus_per_node=2, per_gpu_batch=16, global_batch=32, amp="off",
                image_size=32, epoch=epoch, epochs=2, lr=0.01, lr_peak=0.01,
                lr_scaling="none", warmup_epochs=0, train_loss=2.3, train_acc=10.0,
                val_loss=2.3, val_acc=10.0, train_images=256, val_images=64,
                epoch_time_s=2.0, throughput_img_s=128.0, peak_mem_mib=700.0,
                peak_mem_per_gpu_mib=[700.0, 690.0], data_wait_frac=0.01,
                train_start_unix=1795500000.0 + 10 * epoch,
                eval_start_unix=1795500005.0 + 10 * epoch,
                eval_end_unix=1795500006.0 + 10 * epoch, slowest_rank=slowest,
                rank_spread=spread) | kw


def _run_dir(top: Path, name: str, world: int, spread: float, slow: int) -> Path:
    """A finished 2-epoch run's directory whose log has [METRIC] and [RANKS] lines, as a
    training script writes them (with torchrun's "rank0:"-free output and a progress line)."""
    run = top / name
    run.mkdir(parents=True)
    (run / "job.env").write_text(f"JOB_NAME={name}\nEXIT_CODE=0\nSTRATEGY=ddp\n"
                                 f"WORLD_SIZE={world}\nNODES=1\n")
    text = ["progress: epoch 1/2, step 3/8 | 470.0 img/s | elapsed 0:00 | ETA epoch 0:00"]
    for epoch in (1, 2):
        ranks = [rank(own_s=1.0, compute_s=0.95, data_wait_s=0.05, rank_wait_s=1.0,
                      node=f"node{i}", device=f"cuda:{i}") for i in range(world)]
        ranks[slow] = dict(ranks[slow], own_s=spread, compute_s=spread - 0.05, rank_wait_s=0.1)
        m = _metric(epoch, spread, slow, world_size=world, gpus_per_node=world,
                    global_batch=16 * world, throughput_img_s=100.0 * world / spread,
                    peak_mem_per_gpu_mib=[700.0] * world)
        text += [contract.format_metric_line(m), contract.format_ranks_line(epoch, ranks)]
    text.append(contract.format_metric_line(m | {"total_time_s": 5.0}, final=True))
    (run / "train.log").write_text("\n".join(text) + "\n")
    return run


def test_results_md_shows_and_flags_a_run_held_back_by_one_rank(tmp_path):
    import collect_results
    import csv
    study = tmp_path / "study"
    _run_dir(study, "ddp-1n1g", 1, 1.0, 0)
    _run_dir(study, "ddp-1n2g", 2, 1.02, 1)  # balanced: no table, no flag
    _run_dir(study, "ddp-1n4g", 4, 1.6, 2)   # rank 2 held the others back
    out = tmp_path / "out"
    assert collect_results.main([str(study), "--out", str(out)]) == 0
    md = (out / "results.md").read_text()
    with open(out / "results.csv", newline="") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert rows["ddp-1n4g"]["rank_spread"] == "1.6" and rows["ddp-1n4g"]["slowest_rank"] == "2"
    assert rows["ddp-1n4g"]["straggler"].startswith("straggler: rank 2 took 1.60× the median")
    assert rows["ddp-1n2g"]["straggler"] == "" and rows["ddp-1n2g"]["rank_spread"] == "1.02"
    # the scaling table's row of the held-back run says its efficiency is the straggler's
    table_row = next(l for l in md.splitlines() if l.startswith("| 4 GPUs, 1 Node"))
    assert "| 62% | ok: straggler: rank 2 took 1.60× the median rank's own time, so this " \
           "efficiency is the straggler's, not the strategy's |" in table_row
    assert "straggler" not in next(l for l in md.splitlines()
                                   if l.startswith("| 2 GPUs, 1 Node"))
    section = md[md.index("## Runs held back by one rank"):md.index("## Notes")]
    assert "### ddp-1n4g" in section and "ddp-1n2g" not in section
    # the loader's wait and the wait for the other ranks, each under its own name
    assert "| Compute (s) | Data wait (s) | Rank wait (s) | vs median |" in section
    assert "| **2** | **node2** | **cuda:2** | **1.60** | **1.55** | **0.05** | **0.10** | " \
           "**1.60×** |" in section
    assert "| 0 | node0 | cuda:0 | 1.00 | 0.95 | 0.05 | 1.00 | 1.00× |" in section


def test_of_tied_runs_without_job_env_the_newest_is_described_everywhere(tmp_path):
    """Two finished runs of one configuration, their job.env gone: the tables took the oldest
    (job 5002, held back by rank 1) though --help says the newest (job 5010), and results.md's
    straggler section described the other run."""
    import collect_results
    import csv
    study = tmp_path / "study"
    for name, spread in (("ddp-1n2g-5002", 1.6), ("ddp-1n2g-5010", 1.02)):
        (_run_dir(study, name, 2, spread, 1) / "job.env").unlink()
    out = tmp_path / "out"
    assert collect_results.main([str(study), "--out", str(out)]) == 0
    with open(out / "results.csv", newline="") as f:
        used = {r["run"]: r["used_in_tables"] for r in csv.DictReader(f)}
    assert used == {"ddp-1n2g-5002": "0", "ddp-1n2g-5010": "1"}
    md = (out / "results.md").read_text()
    table_row = next(l for l in md.splitlines() if l.startswith("| 2 GPUs, 1 Node"))
    assert "straggler" not in table_row and "196" in table_row, table_row
    assert "## Runs held back by one rank" not in md


def test_results_md_says_a_two_rank_straggler_against_the_other_rank(tmp_path):
    """It said "took 1.24× the median rank's own time" of a rank 1.63 times slower than the
    other: the median of two ranks is their mean."""
    import collect_results
    run = _run_dir(tmp_path / "study", "ddp-1n2g", 2, 1.24, 1)
    out = tmp_path / "out"
    assert collect_results.main([str(run), "--out", str(out)]) == 0
    assert "straggler: rank 1 took 1.63× the other rank's own time" in \
        (out / "results.md").read_text()


def test_a_log_without_ranks_lines_reads_as_before(tmp_path):
    """Logs written before [RANKS] and rank_spread existed: no flag, no table, no error."""
    from reporting import stragglers as report_stragglers
    assert report_stragglers.read_ranks(tmp_path / "missing.log") == {}
    row = dict(run="old", path=str(tmp_path), epoch="2")
    report_stragglers.flag([row])
    assert "straggler" not in row and report_stragglers.ranks_markdown([row]) == []
    cut = contract.format_ranks_line(1, [rank(), rank()])
    (tmp_path / "train.log").write_text(cut[:-20])  # killed mid-write
    assert report_stragglers.read_ranks(tmp_path / "train.log") == {}


def test_the_timeline_marks_the_slow_rank(tmp_path):
    pytest.importorskip("matplotlib")
    from reporting import plots, timeline
    run = _run_dir(tmp_path, "ddp-1n4g", 4, 1.45, 3)
    phases = timeline.read_phases([run / "train.log"], [])
    assert [p["slow"] for p in phases] == ["rank 3 +45%", "rank 3 +45%"]
    from matplotlib.figure import Figure
    ax = Figure().subplots()
    plots._mark_phases(ax, phases, phases[0]["train_start"], with_labels=True)
    marks = [t.get_text() for t in ax.texts if t.get_gid() == "straggler"]
    assert marks == [" rank 3 +45%", " rank 3 +45%"]
    # the legend says what the red names are, once
    keys = [ln.get_label() for ln in ax.get_lines() if ln.get_gid() == "straggler key"]
    assert keys == ["rank that held\nthe others back,\n% slower"]
    assert "rank that held\nthe others back,\n% slower" in ax.get_legend_handles_labels()[1]
    unmarked = Figure().subplots()
    plots._mark_phases(unmarked, [dict(p, slow=None) for p in phases], phases[0]["train_start"],
                       with_labels=True)
    assert not [ln for ln in unmarked.get_lines() if ln.get_gid() == "straggler key"]
    # of two ranks, the figure of the training's line, "67% slower than the other rank" (the
    # median of two is their mean: the timeline said +25%)
    pair = _run_dir(tmp_path, "ddp-1n2g", 2, 1.25, 0)
    assert [p["slow"] for p in timeline.read_phases([pair / "train.log"], [])] == \
        ["rank 0 +67%", "rank 0 +67%"]
    balanced = _run_dir(tmp_path, "balanced", 2, 1.05, 1)
    assert [p["slow"] for p in timeline.read_phases([balanced / "train.log"], [])] == [None,
                                                                                       None]


def test_dataparallel_on_the_cpu_is_one_device_and_names_nobody():
    proc = run_script("dp_train.py", RUN[:2] + ["--synthetic-size", "64", "--epochs", "1",
                                                "--num-workers", "0", "--device", "cpu"])
    check_ok(proc)
    assert [(m["slowest_rank"], m["rank_spread"]) for m in metrics(proc.stdout)] == [("0", "1")] * 2
    assert "straggler:" not in proc.stdout and contract.RANKS_PREFIX not in proc.stdout
