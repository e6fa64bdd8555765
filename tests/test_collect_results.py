"""collect_results.py on a fixture study with known numbers (tests/fixtures/study).

The fixture is a Slurm study of ResNet-50 on TinyImageNet, weak scaling at 64 images per GPU,
3 epochs, made like launch/run_benchmarks.py and launch/job.sh make one: study.json, one run
directory per job (job.env written with bash printf %q, train.log modelled on real output,
nvidia-smi and psrecord logs) and Slurm .out files. What each run is:

  ddp-1n1g-5001   ok        1000.0 img/s; GPU 0 samples 8000 12000 10000 10000 -> Avg 10000
  ddp-1n2g-5002   ok        1900.0 img/s; GPU 0 Avg 10500; one [METRIC] line with rank 1's
                            warning glued to it (unparseable), one after rank 1's text (parses)
  ddp-1n4g-5003   failed    CUDA OOM in epoch 2, exit 1; superseded by ddp-1n4g-5010
  ddp-1n4g-5010   ok        3600.0 img/s; GPU 0 Avg 11000
  ddp-2n4g-5004   ok        requeued once (USR1), finished: 6800.0 img/s; GPU 0 of gn04 (first
                            node): 10000 14000 + restart 12000 x4 -> Peak 14000, Avg 12000,
                            Mode 12000 (gn05's GPU 0 is at 20000 and must not be used)
  ddp-4n4g-5005   partial   killed in epoch 3, no EXIT_CODE: epoch 2 at 12800.0 img/s, Avg 12500
  ddp-8n4g        missing   submitted as job 5006, no run directory
  fsdp-1n1g-5101  failed    exit 1 before the first epoch: fsdp has no 1-GPU baseline
  fsdp-1n2g-5102  ok        1800.0 img/s
  fsdp-1n4g-5103  requeued  exit 75 after epoch 2 (3100.0 img/s)
  fsdp-2n4g       failed    only fsdp-2n4g-5104.out: the job died before making its run directory
  fsdp-4n4g/8n4g  missing   planned, never submitted
  dp-1n1g/2g/4g   ok        800.0 / 1200.0 / 1600.0 img/s; GPU 0 Avg 9000 / 13500 / 18000
  dp-2n4g ...     skipped   DataParallel runs on one node
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TESTS, env_for_tests

import collect_results
from reporting import plots, report, scaling
from training import contract

STUDY = TESTS / "fixtures" / "study"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def collect(paths, out: Path, *extra) -> tuple:
    """collect_results.main in-process; returns (exit code, rows by run, results.md text)."""
    code = collect_results.main([*map(str, paths), "--out", str(out), *extra])
    rows, md = {}, ""
    if (out / "results.csv").exists():
        with open(out / "results.csv", newline="") as f:
            rows = {r["run"]: r for r in csv.DictReader(f)}
        md = (out / "results.md").read_text()
    return code, rows, md


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    code, rows, md = collect([STUDY], out, "--plot")
    assert code == 0
    return rows, md, out


# --------------------------------------------------------------------------------------------
# The contract with the training scripts
# --------------------------------------------------------------------------------------------

def test_every_line_tag_and_exit_code_is_defined_once_in_contract():
    """Writer and readers share contract.py (which imports no torch): no other module spells
    a line tag or the requeue exit code itself, so they cannot drift apart."""
    assert "import torch" not in (REPO / "training" / "contract.py").read_text()
    tags = [q + t + q for t in ("[METRIC]", "[STOP]", "[EXIT]", "[PROFILE]", "[BANDWIDTH]")
            for q in "\"'"]
    tags.append("= 75")
    paths = [p for folder in ("", "training/", "reporting/", "launch/", "bench/")
             for p in sorted(REPO.glob(folder + "*.py"))]
    assert len(paths) > 20
    for path in paths:
        if path.relative_to(REPO) != Path("training/contract.py"):
            text = path.read_text()
            assert not [t for t in tags if t in text], path.name


# --------------------------------------------------------------------------------------------
# Why not N x: the step's parts and the scaling model
# --------------------------------------------------------------------------------------------

def _inputs(strategy="ddp", t1=100.0, node=1.0, inter=1.0, messages=None, latency_us=0.0,
            carried=0.0):
    ops = scaling.COLLECTIVES[strategy]
    return dict(strategy=strategy, t1=t1, grad_bytes=1e8, busbw_node=dict.fromkeys(ops, node),
                busbw_inter=dict.fromkeys(ops, inter), latency_us=latency_us, carried=carried,
                hidden=scaling.OVERLAP[strategy],
                messages=messages or ({"all_reduce": 4} if strategy == "ddp" else
                                      {"all_gather": 34, "reduce_scatter": 17}))


def test_the_scaling_model_reproduces_a_hand_computed_example():
    # DDP, 16 GPUs on one node: all-reduce 2 x 15/16 x 100 MB / 1 GB/s = 187.5 ms, of which
    # 2/3 x 100 ms hide behind backward: 100 + 187.5 - 66.67 = 220.83 ms a step
    assert scaling.predict_step_ms(_inputs(), 1, 16) == pytest.approx(100 + 187.5 - 200 / 3)
    # FSDP, 4 GPUs: 2 all-gathers (2 x 3/4 x 100 MB / 2 GB/s = 75 ms) and a reduce-scatter
    # (3/4 x 100 MB / 1 GB/s = 75 ms), hidden behind the whole 100 ms step: 150 ms
    fsdp = _inputs("fsdp", node=2.0)
    fsdp["busbw_node"]["reduce_scatter"] = 1.0
    assert scaling.predict_step_ms(fsdp, 1, 4) == pytest.approx(150.0)
    assert scaling.predict_step_ms(_inputs(t1=80.0), 1, 1) == 80.0
    # fast links hide all of it; the carried overhead comes on top
    assert scaling.predict_step_ms(_inputs(node=100.0), 1, 8) == 100
    assert scaling.predict_step_ms(_inputs(node=100.0, carried=7.5), 1, 8) == 107.5


def test_the_model_runs_between_nodes_at_the_slower_link_and_pays_each_ring_step():
    # 2 nodes x 8 at 50 GB/s within a node, 10 between: the ring runs at 10 GB/s;
    # 2 x 15/16 x 100 MB / 10 GB/s = 18.75 ms, none hidden behind a 0.03 ms step
    fast = _inputs(t1=0.03, node=50.0, inter=10.0)
    assert scaling.predict_step_ms(fast, 2, 8) == pytest.approx(0.03 + 18.75 - 0.02)
    # the latency term: 4 buckets x 2(N-1) ring steps x 10 us, at 512 GPUs 40.88 ms on top of
    # the bytes (2 x 511/512 x 10 ms = 19.96 ms)
    slow = _inputs(t1=0.03, node=50.0, inter=10.0, latency_us=10.0)
    assert scaling.comm_ms("ddp", 512, 1e8, {"all_reduce": 10.0}, {"all_reduce": 4}, 10.0) == \
        pytest.approx(2 * 511 / 512 * 10 + 4 * 2 * 511 * 0.01)
    assert scaling.predict_step_ms(slow, 64, 8) - scaling.predict_step_ms(fast, 64, 8) == \
        pytest.approx(40.88)
    # FSDP: (gathers + scatters) x (N-1) ring steps; grad-op gathers once per scatter
    assert scaling.comm_ms("fsdp", 4, 1e8, {"all_gather": 1.0, "reduce_scatter": 1.0},
                           {"all_gather": 17, "reduce_scatter": 17}, 10.0) == \
        pytest.approx(75 + 75 + 34 * 3 * 0.01)


PROFILED = {  # lines --profile adds to the fixture study's train.logs
    "ddp-1n1g-5001": ["[PROFILE] steps=5 step_ms=64.000 compute_ms=50.000 exposed_comm_ms=0.000 "
                      "data_wait_ms=4.000 other_ms=10.000 comm_ms=0.000 trace=/r/t.json"],
    "ddp-2n4g-5004": [
        "[BANDWIDTH] op=all_reduce bytes=25000000 world_size=8 time_ms=20 algbw_gbs=1.25 "
        "busbw_gbs=2.188",
        "[BANDWIDTH] op=all_reduce bytes=100000000 world_size=8 time_ms=70 algbw_gbs=1.429 "
        "busbw_gbs=2.500 transport=IB/GDRDMA:mlx5_0+P2P/IPC",
        "[PROFILE] steps=5 step_ms=75.000 compute_ms=50.000 exposed_comm_ms=15.000 "
        "data_wait_ms=2.000 other_ms=8.000 comm_ms=40.000 trace=/r/t.json"],
}


def test_bandwidth_lines_give_their_transport_and_older_ones_still_parse(tmp_path):
    """The transport of the largest message's [BANDWIDTH] line goes into the row; a log from
    before the transport= key gives the same figures and an empty transport."""
    log = tmp_path / "train.log"
    old = ("[BANDWIDTH] op=all_reduce bytes=4000 world_size=2 time_ms=1 algbw_gbs=0.004 "
           "busbw_gbs=0.004\n"
           "[BANDWIDTH] op=all_reduce bytes=400000 world_size=2 time_ms=2 algbw_gbs=0.2 "
           "busbw_gbs=0.200\n")
    log.write_text(old)
    found = collect_results.read_explanations(log)
    assert (found["busbw_all_reduce_gbs"], found["transport"]) == ("0.200", "")
    log.write_text(old.replace("busbw_gbs=0.004", "busbw_gbs=0.004 transport=gloo-tcp:lo")
                   .replace("busbw_gbs=0.200", "busbw_gbs=0.200 transport=socket:eth0"))
    found = collect_results.read_explanations(log)
    assert (found["busbw_all_reduce_gbs"], found["transport"]) == ("0.200", "socket:eth0")
    assert "transport" in collect_results.TAIL


def test_the_study_says_where_the_step_time_goes_and_predicts_beyond_itself(tmp_path):
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    for run, lines in PROFILED.items():
        log = study / run / "train.log"
        log.write_text("\n".join(lines) + "\n" + log.read_text())
    code, rows, md = collect([study], tmp_path / "out", "--plot")
    assert code == 0
    assert (tmp_path / "out" / "step_breakdown.png").read_bytes()[:8] == PNG_MAGIC
    base, two = rows["ddp-1n1g-5001"], rows["ddp-2n4g-5004"]
    # step time from the final epoch: epoch time x global batch / images
    t1 = float(base["epoch_time_s"]) * 1e3 * 64 / float(base["train_images"])
    assert float(base["step_ms"]) == pytest.approx(t1, abs=1e-4)
    assert (base["profile_compute_ms"], two["profile_exposed_comm_ms"]) == ("50.000", "15.000")
    assert (two["grad_bytes"], two["busbw_all_reduce_gbs"]) == ("100000000", "2.500")
    # the network that carried the figure (a run without a [BANDWIDTH] line: none)
    assert (two["transport"], base["transport"]) == ("IB/GDRDMA:mlx5_0+P2P/IPC", "")
    # by hand, at the study's largest run, 4 nodes x 4 (partial, but its epochs have numbers):
    # the bus bandwidth from the only run that measured it (2 nodes x 4, so also the figure
    # within a node): 2 x 15/16 x 100 MB / 2.5 GB/s = 75 ms, plus 4 buckets (100 MB in DDP's
    # 25 MiB: this log did not count them) x 2 x 15 ring steps x 10 us = 1.2 ms. With 2/3 of t1
    # hidden that is more than the run took: the model is fitted to it by the share hidden, h.
    four = rows["ddp-4n4g-5005"]
    step4 = float(four["step_ms"])
    usual = t1 + 76.2 - 2 / 3 * t1
    assert step4 < usual
    h = (76.2 - (step4 - t1)) / t1
    assert float(four["predicted_step_ms"]) == pytest.approx(step4, abs=1e-4)
    assert float(four["prediction_error"]) == 0
    # 2 nodes x 4: 70 ms + 4 x 2 x 7 x 10 us = 70.56 ms, against its measured step
    predicted = t1 + 70.56 - h * t1
    assert float(two["predicted_step_ms"]) == pytest.approx(predicted, abs=1e-3)
    assert float(two["prediction_error"]) == pytest.approx(
        predicted / float(two["step_ms"]) - 1, abs=1e-3)
    # one node, 2 GPUs: 2 x 1/2 x 100 MB / 2.5 GB/s + 4 x 2 x 10 us = 40.08 ms, all of it
    # hidden behind backward
    assert float(rows["ddp-1n2g-5002"]["predicted_step_ms"]) == pytest.approx(t1, abs=1e-3)
    # the final epoch's step and data wait, then the profiled step and its parts, which add
    # up to it (50 + 0 + 4 + 10 = 64; 50 + 15 + 2 + 8 = 75), then all communication
    assert "| 1 node x 1 GPU | 64.0 | — | 64.0 | 50.0 | 0.0 | 4.0 | 10.0 | 0.0 | — |" in md
    assert ("| 2 nodes x 4 GPUs | 75.3 | — | 75.0 | 50.0 | 15.0 | 2.0 | 8.0 | 40.0 | all_reduce "
            "2.500 over IB/GDRDMA:mlx5_0+P2P/IPC |") in md
    assert "collectives over IB/GDRDMA:mlx5_0+P2P/IPC." in md  # the group's context line
    at64 = t1 + 2 * 255 / 256 * 40 + 4 * 2 * 255 * 0.01 - h * t1
    assert f"| 64 nodes x 4 GPUs | 256 | {at64:.1f} | {t1 / at64:.0%} | — | — |" in md
    error = predicted / float(two["step_ms"]) - 1
    assert f"| 2 nodes x 4 GPUs | 8 | {predicted:.1f} | {t1 / predicted:.0%} | 75.3 | " \
           f"{error:+.0%} |" in md
    assert f"| 4 nodes x 4 GPUs | 16 | {step4:.1f} | {t1 / step4:.0%} | {step4:.1f} | +0% " \
           f"(the model is fitted here) |" in md
    # (partial: its step time is its last complete epoch's, and said so)
    assert (f"h = {h:.2f}, fitted: the study's largest run, ddp-4n4g-5005, took {step4:.1f} ms "
            f"a step (epoch 2 of 3), less than the {usual:.1f} ms that h = 0.67 gives") in md
    assert "- carried overhead: 0.0 ms\n" in md
    assert ("- between nodes: all_reduce 2.5 GB/s (measured by ddp-2n4g-5004, 2 nodes x 4)"
            in md)
    assert "all_reduce 4 (assumed: the run did not count them" in md
    # fsdp's 1-GPU run failed: no model, and the reason; dp (one process) has none to give
    assert "no scaling model: it needs the 1-GPU run's step time" in md
    assert "no scaling model for dp" not in md


def test_the_plots_get_the_studys_numbers(tmp_path):
    """plot_data hands plots.py exactly the tables' numbers: a line per strategy through its
    1-node runs and one through its node sweep (open markers for runs that did not finish),
    the ideal line from the 1-GPU baseline, and a bar per configuration: the traced parts
    where profiled, else the data wait and the rest of the step."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    for run, lines in PROFILED.items():
        log = study / run / "train.log"
        log.write_text("\n".join(lines) + "\n" + log.read_text())
    rows = collect_results.read_inputs([study])
    chosen = scaling.scale(rows)
    scaling.step_times(rows)
    series, ideal, bars = report.plot_data(chosen)
    lines = {s["label"]: (s["line"], [(p["gpus"], p["throughput_img_s"], p["partial"])
                                      for p in s["points"]]) for s in series}
    assert lines == {
        "dp, 1 node": ("-", [(1, 800.0, False), (2, 1200.0, False), (4, 1600.0, False)]),
        "ddp, 1 node": ("-", [(1, 1000.0, False), (2, 1900.0, False), (4, 3600.0, False)]),
        "ddp, 4 GPU/node, 1-4 nodes": ("--", [(4, 3600.0, False), (8, 6800.0, False),
                                              (16, 12800.0, True)]),
        "fsdp, 1 node": ("-", [(2, 1800.0, False), (4, 3100.0, True)]),  # no 1-GPU run
    }
    assert [(label, xs, ys) for _group, label, xs, ys in ideal] == [
        ("dp, ideal (1-GPU x GPUs)", [1, 2, 4], [800.0, 1600.0, 3200.0]),
        ("ddp, ideal (1-GPU x GPUs)", [1, 2, 4, 8, 16], [1000.0, 2000.0, 4000.0, 8000.0, 16000.0])]
    bars = dict(bars)
    assert bars["ddp, 1 node x 1 GPU"] == dict(compute=50.0, exposed_comm=0.0, data_wait=4.0,
                                              other=10.0)
    assert bars["ddp, 2 nodes x 4 GPUs"] == dict(compute=50.0, exposed_comm=15.0,
                                                data_wait=2.0, other=8.0)
    step = float(next(r for r in rows if r["run"] == "dp-1n4g-5203")["step_ms"])
    assert bars["dp, 1 node x 4 GPUs"] == dict(data_wait=0.0, unprofiled=step) and step > 0
    assert len(bars) == 10  # every configuration with a step time, fsdp's failed one not


def test_the_validation_plot_says_how_many_steps_an_epoch_had(tmp_path, monkeypatch):
    """A final epoch's loss at 16 GPUs comes after a tenth of the steps of one GPU's (a fixed
    batch per GPU): val_loss_acc.png says so under its panels, from the runs' own logs."""
    rows = collect_results.read_inputs([STUDY])
    series, ideal, bars = report.plot_data(scaling.scale(rows))
    footnotes = {}
    figure = pytest.importorskip("matplotlib.figure")

    def record(fig, path, **_kw):
        fig.canvas.draw()  # each footnote line ends inside the figure, as it is written
        lines = sorted((t for t in fig.texts if t.get_gid() == "footnote"),
                       key=lambda t: -t.get_position()[1])  # top to bottom
        assert all(t.get_window_extent().x1 <= fig.bbox.x1 for t in lines), Path(path).name
        footnotes[Path(path).name] = [t.get_text() for t in lines]
    monkeypatch.setattr(figure.Figure, "savefig", record)
    plots.study_plots(series, ideal, bars, tmp_path, dpi=50)
    *steps, markers = footnotes["val_loss_acc.png"]
    assert " ".join(steps) == (
        "steps per epoch (training images / global batch): 1 GPU: 1,562; 2 GPUs: 781; "
        "4 GPUs: 390; 8 GPUs: 195; 16 GPUs: 97; fewer, larger steps with more GPUs")
    assert markers == "open markers: partial or requeued runs (last completed epoch)"
    assert footnotes["throughput.png"] == [markers]
    # a study of 1 to 64 GPUs and two batch sizes: more lines, none past the figure's edge
    wide = [dict(s, points=[dict(p, gpus=2 ** k, steps=3125 // 2 ** k + b) for k in range(7)
                            for b in (0, 1) for p in s["points"][:1]]) for s in series]
    plots.study_plots(wide, ideal, bars, tmp_path, dpi=50)
    assert len(footnotes["val_loss_acc.png"]) >= 2
    assert "; 64 GPUs: 48/49; fewer" in " ".join(footnotes["val_loss_acc.png"])
    # strong scaling (one global batch), a CPU study, a log without the figures
    point = dict(device="cpu", partial=False)
    assert plots.steps_note([point | dict(gpus=1, steps=100), point | dict(gpus=2, steps=100)]) \
        == "steps per epoch (training images / global batch): 100 at every process count"
    assert plots.steps_note([point | dict(gpus=1, steps=100), point | dict(gpus=2, steps=50),
                             point | dict(gpus=2, steps=25)]) == (
        "steps per epoch (training images / global batch): 1 process: 100; 2 processes: 25/50; "
        "fewer, larger steps with more processes")
    assert plots.steps_note([point | dict(gpus=1, steps=None)]) is None
    assert report.steps_per_epoch({"train_images": "99968", "global_batch": "64"}) == 1562
    assert report.steps_per_epoch({"train_images": "99968"}) is None


def test_a_strategy_keeps_its_colour_in_a_study_without_the_others(tmp_path, monkeypatch):
    """dp, ddp and fsdp are drawn in their own colours whichever strategies a study ran: a
    study of ddp and fsdp alone draws ddp orange and fsdp green, as beside dp, not blue and
    orange (the colour of a strategy's place among those present)."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    for run in study.glob("dp-*"):
        shutil.rmtree(run)
    rows = collect_results.read_inputs([study])
    series, ideal, bars = report.plot_data(scaling.scale(rows))
    assert {s["strategy"] for s in series} == {"ddp", "fsdp"}
    drawn = {}
    figure = pytest.importorskip("matplotlib.figure")

    def record(fig, path, **_kw):
        drawn[Path(path).name] = {line.get_label(): line.get_color()
                                  for ax in fig.axes for line in ax.get_lines()}
    monkeypatch.setattr(figure.Figure, "savefig", record)
    plots.study_plots(series, ideal, bars, tmp_path, dpi=50)
    lines = drawn["throughput.png"]
    assert lines["ddp, 1 node"] == lines["ddp, 4 GPU/node, 1-4 nodes"] == "C1"
    assert lines["ddp, ideal (1-GPU x GPUs)"] == "C1"
    assert lines["fsdp, 1 node"] == "C2"
    assert drawn["peak_memory.png"]["ddp, 1 node"] == "C1"


def test_plot_without_step_times_leaves_out_the_breakdown(tmp_path):
    """A [METRIC] line without the figures of a step time (an older script's) still gets the
    plots that need none; the step breakdown is left out, not drawn empty or a traceback."""
    run = tmp_path / "ddp-1n1g-1"
    run.mkdir()
    (run / "train.log").write_text(
        "[METRIC] strategy=ddp model=cnn dataset=synthetic device=cpu world_size=1 nodes=1 "
        "gpus_per_node=1 epoch=1 epochs=1 val_loss=1.5 val_acc=40 epoch_time_s=3 "
        "throughput_img_s=50 peak_mem_mib=10 final=1 total_time_s=4\n")
    (run / "job.env").write_text("EXIT_CODE=0\n")
    code = collect_results.main([str(run), "--out", str(tmp_path / "out"), "--plot"])
    assert code == 0
    written = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    # and no memory breakdown: this log has no [MEMORY] line
    assert written == sorted(set(plots.PLOTS) - {"step_breakdown.png", "memory_breakdown.png"})
    assert "step_breakdown.png" not in (tmp_path / "out" / "results.md").read_text()


def study_figures(study: Path, out: Path, monkeypatch) -> dict:
    """collect_results --plot of a study: its figures by title, as drawn (no timelines)."""
    figures = {}
    pyplot = plots._pyplot()
    close = pyplot.close
    monkeypatch.setattr(pyplot, "close", lambda fig: figures.setdefault(fig._suptitle.get_text(),
                                                                       fig))
    monkeypatch.setattr(collect_results, "write_timelines", lambda *args: [])
    assert collect_results.main([str(study), "--out", str(out), "--plot"]) == 0
    for fig in figures.values():
        close(fig)
    return figures


def test_the_memory_plots_legend_names_the_lines_of_both_panels(tmp_path, monkeypatch):
    """Only ddp's runs have an nvidia-smi log: the legend, on the GPU 0 panel, named ddp
    alone, and the other panel's dp and fsdp lines went unexplained."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    for folder in study.glob("*/gpu_memory"):
        if not folder.parent.name.startswith("ddp-"):
            shutil.rmtree(folder)
    figures = study_figures(study, tmp_path / "out", monkeypatch)
    gpu, allocated = figures["Peak memory per GPU"].axes

    def named(ax):
        return {line.get_label() for line in ax.lines if not line.get_label().startswith("_")}
    drawn = named(gpu) | named(allocated)
    assert named(gpu) < drawn and named(gpu) == {n for n in drawn if n.startswith("ddp")}
    assert {t.get_text() for t in gpu.get_legend().get_texts()} == drawn
    assert allocated.get_legend() is None


def test_a_panel_without_a_finite_value_says_so_not_an_empty_legend(tmp_path, monkeypatch):
    """val_loss=nan and throughput_img_s=0 in every run: the panel said nothing, the val_loss
    one had a legend of four invisible nan lines, and the throughput title blamed a missing
    1-GPU run that the study has."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    for log in study.glob("*/train.log"):
        log.write_text(re.sub(r"throughput_img_s=[\d.]+", "throughput_img_s=0",
                              re.sub(r"val_loss=[\d.]+", "val_loss=nan", log.read_text())))
    figures = study_figures(study, tmp_path / "out", monkeypatch)
    loss, acc = figures["Validation loss and accuracy (final epoch)"].axes
    assert not loss.lines and loss.get_legend() is None
    assert [t.get_text() for t in loss.texts] == ["nothing to draw: no run logged a finite "
                                                  "val_loss"]
    assert len(acc.get_legend().get_texts()) == 4
    title = next(t for t in figures if t.startswith("Throughput"))
    assert "1-GPU run" not in title and "no run logged one above 0" in title
    assert "throughput_img_s above 0" in figures[title].axes[0].texts[0].get_text()


def test_plot_draws_every_runs_timeline_into_the_output_folder(study):
    _rows, _md, out = study
    names = sorted(p.name for p in out.glob("timeline-*.png"))
    assert "timeline-ddp-2n4g-5004.png" in names and len(names) == 11  # runs with memory logs
    assert all((out / n).read_bytes()[:8] == PNG_MAGIC for n in names)
    assert not list(STUDY.rglob("timeline*.png"))  # the run directories are left as they are


def test_two_runs_of_the_same_name_get_a_timeline_each(tmp_path):
    """Two studies each with a run of the same name: the second timeline replaced the first.
    A third run named ddp-1g-2 keeps its own name; the second ddp-1g takes the next one."""
    runs = [tmp_path / "monday" / "ddp-1g", tmp_path / "tuesday" / "ddp-1g",
            tmp_path / "wednesday" / "ddp-1g-2"]
    for run in runs:
        shutil.copytree(TESTS / "fixtures" / "memory" / "timeline_run", run)
    shutil.rmtree(runs[1] / "gpu_memory")  # a timeline of its own
    out = tmp_path / "out"
    assert collect_results.main([*map(str, runs), "--out", str(out), "--plot"]) == 0
    first, second, third = (out / f"timeline-ddp-1g{n}.png" for n in ("", "-3", "-2"))
    assert first.read_bytes()[:8] == second.read_bytes()[:8] == third.read_bytes()[:8] == PNG_MAGIC
    assert first.read_bytes() != second.read_bytes()  # monday's run, then tuesday's
    assert len(list(out.glob("timeline-*.png"))) == 3
    md = (out / "results.md").read_text()
    assert (f"- ddp-1g: timeline-ddp-1g-3.png is the timeline of {runs[1]}: an earlier run is "
            f"named ddp-1g too") in md, md
    assert md.count("an earlier run is named") == 1
    # Collected again without monday's run: its timeline went, the others are drawn again
    # (before, timeline-ddp-1g-3.png of the earlier collection stayed, for a run not there).
    assert collect_results.main([*map(str, runs[1:]), "--out", str(out), "--plot"]) == 0
    assert sorted(p.name for p in out.glob("timeline-*.png")) == [
        "timeline-ddp-1g-2.png", "timeline-ddp-1g.png"]


@pytest.mark.parametrize("tz, noted", [("UTC", False), ("JST-9", True)])
def test_plot_puts_what_the_timeline_notes_into_results_md(tmp_path, tz, noted):
    """The fixture run's nvidia-smi times are UTC: read in another time zone, its epochs fall
    outside the GPU logs, and results.md says so (before, only analyze_memory.py --plot did)."""
    run = TESTS / "fixtures" / "memory" / "timeline_run"
    p = subprocess.run([sys.executable, str(REPO / "collect_results.py"), str(run), "--out",
                        str(tmp_path), "--plot"], capture_output=True, text=True, timeout=120,
                       env=env_for_tests({"TZ": tz}))
    assert p.returncode == 0, p.stderr
    md = (tmp_path / "results.md").read_text()
    assert (f"- timeline_run: timeline: {run}: the epochs of the training log lie outside the "
            f"GPU logs' time span" in md) == noted
    assert md.count("skipped 2 line(s)") == 1  # the memory notes are not repeated


def test_plot_leaves_a_cpu_only_runs_alignment_out_of_results_md(tmp_path):
    """Every CPU-only run's timeline places its psrecord log by the file's time; said once per
    run, that note would fill results.md's Notes (analyze_memory.py --plot still says it)."""
    run = tmp_path / "cpu_run"
    shutil.copytree(TESTS / "fixtures" / "memory" / "timeline_run", run)
    shutil.rmtree(run / "gpu_memory")
    assert collect_results.main([str(run), "--out", str(tmp_path / "out"), "--plot"]) == 0
    assert (tmp_path / "out" / "timeline-cpu_run.png").exists()
    assert "align" not in (tmp_path / "out" / "results.md").read_text()


def test_plot_of_a_run_without_a_usable_log_gives_the_reason_once(tmp_path):
    """A run whose only memory log is empty: its memory note says why, and the timeline's
    note says that none was drawn without repeating the reason."""
    run = tmp_path / "empty_run"
    (run / "gpu_memory").mkdir(parents=True)
    (run / "gpu_memory" / "n1.csv").write_text("")
    shutil.copy(TESTS / "fixtures" / "memory" / "timeline_run" / "train.log", run)
    collect_results.main([str(run), "--out", str(tmp_path / "out"), "--plot"])
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.count("the file is empty") == 1
    assert "- empty_run: no timeline drawn\n" in md


def test_a_timeline_that_cannot_be_written_is_noted_with_the_output_folder(tmp_path, monkeypatch):
    """The outputs are written to a staging folder and moved into --out together; a note about
    a timeline that failed to write names --out, not the staging folder, gone by then."""
    def fail(run_dir, path, notes, alignment_notes):
        raise OSError(f"[Errno 28] No space left on device: '{path}'")

    monkeypatch.setattr(collect_results.analyze_memory, "plot_timeline", fail)
    run = TESTS / "fixtures" / "memory" / "timeline_run"
    out = tmp_path / "out"
    assert collect_results.main([str(run), "--out", str(out), "--plot"]) == 0
    md = (out / "results.md").read_text()
    assert (f"- timeline_run: no timeline drawn: [Errno 28] No space left on device: "
            f"'{out / 'timeline-timeline_run.png'}'") in md, md
    assert ".collect_results-" not in md


def test_without_bandwidth_figures_the_model_says_how_to_get_them(study):
    _rows, md, _out = study
    assert "no run measured its bus bandwidth; run the study with `-- --profile`" in md
    assert "| 2 nodes x 4 GPUs | 75.3 | — | not profiled | — | — | — | — | — | — |" in md


def test_a_real_metric_line_round_trips(tmp_path):
    m = dict(strategy="ddp", model="cnn", dataset="synthetic", device="cpu", world_size=2,
             nodes=1, gpus_per_node=2, per_gpu_batch=16, global_batch=32, amp="off",
             image_size=32, epoch=2, epochs=2, lr=0.01, train_loss=2.298062, train_acc=17.1875, val_loss=2.294444,
             val_acc=18.75, train_images=256, val_images=64, epoch_time_s=0.5164306,
             throughput_img_s=495.7104, peak_mem_mib=771.1953,
             peak_mem_per_gpu_mib=[771.1953, 765.1094], total_time_s=1.199915, lr_peak=0.01,
             lr_scaling="none", warmup_epochs=0.0, data_wait_frac=0.02,
             train_start_unix=1795500000.0, eval_start_unix=1795500000.5,
             eval_end_unix=1795500000.7, slowest_rank=1, rank_spread=1.03)
    run = tmp_path / "ddp-1n2g-1"
    run.mkdir()
    (run / "job.env").write_text("JOB_NAME=ddp-1n2g\nEXIT_CODE=0\n")
    log = run / "train.log"
    log.write_text(contract.format_metric_line(m) + "\n" + contract.format_metric_line(m, final=True)
                   + "\n")
    lines, bad = collect_results.read_log(log)
    assert len(lines) == 2 and not bad
    final = lines[-1]
    assert float(final["throughput_img_s"]) == 495.7104
    assert [float(v) for v in final["peak_mem_per_gpu_mib"].split("/")] == [771.1953, 765.1094]
    assert final["epoch_time_s"] == "0.5164306"  # the CSV keeps the logged text
    assert final["eval_end_unix"] == "1795500000.7"  # clock times keep their tenths
    # results.csv has every [METRIC] key, in the writer's order, then total_time_s.
    code, rows, _ = collect([run], tmp_path / "out")
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        cols = next(csv.reader(f))
    at = cols.index(contract.METRIC_KEYS[0])
    keys = contract.METRIC_KEYS + contract.FINAL_KEYS[1:]
    assert code == 0 and tuple(cols[at:at + len(keys)]) == keys
    assert rows["ddp-1n2g-1"]["epoch_time_s"] == "0.5164306"
    assert rows["ddp-1n2g-1"]["status"] == "ok"


def test_a_copy_of_the_script_alone_names_what_to_copy(tmp_path):
    shutil.copy(REPO / "collect_results.py", tmp_path)
    proc = subprocess.run([sys.executable, str(tmp_path / "collect_results.py"), str(STUDY)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "error: collect_results.py needs analyze_memory.py beside it: copy analyze_memory.py "
        "and the folders reporting/ and training/ from the repository too, or run the "
        "repository's copy"]
    shutil.copy(REPO / "analyze_memory.py", tmp_path)  # the one missing is named
    shutil.copytree(REPO / "reporting", tmp_path / "reporting")
    (tmp_path / "reporting" / "timeline.py").unlink()
    proc = subprocess.run([sys.executable, str(tmp_path / "collect_results.py"), str(STUDY)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: collect_results.py needs reporting/timeline.py "
                                  "beside it: ")


def test_runs_without_torch(tmp_path):
    """collect_results.py works where torch is not installed (tests/no_torch.py makes it
    unimportable), plots included; the same blocker does stop a script that needs torch."""
    def no_torch(*args):
        return subprocess.run([sys.executable, str(TESTS / "no_torch.py"), *map(str, args)],
                              capture_output=True, text=True, env=env_for_tests(), cwd=REPO,
                              timeout=300)
    proc = no_torch(REPO / "collect_results.py", STUDY, "--plot", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 19
    assert (tmp_path / "throughput.png").read_bytes()[:8] == PNG_MAGIC
    proc = no_torch(REPO / "ddp_train.py", "--help")
    assert proc.returncode != 0 and "No module named 'torch' (tests/no_torch.py)" in proc.stderr


def test_plot_without_matplotlib_is_one_sentence_and_writes_nothing(tmp_path):
    """Without matplotlib, --plot stops before anything is written (exit 2, one sentence);
    without --plot the same environment collects the study."""
    script = (
        "import sys\n"
        "class NoMatplotlib:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoMatplotlib())\n"
        "import collect_results\n"
        "sys.exit(collect_results.main(sys.argv[1:]))\n")

    def run(*args):
        return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, env=env_for_tests(), timeout=300)
    proc = run(STUDY, "--plot", "--out", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --plot needs matplotlib: pip install matplotlib (it is in requirements.txt), "
        "or drop --plot"]
    assert not (tmp_path / "out").exists()
    proc = run(STUDY, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "results.md").is_file()


# --------------------------------------------------------------------------------------------
# Scaling factors and efficiencies, exactly
# --------------------------------------------------------------------------------------------

def test_scaling_factors_and_efficiencies(study):
    rows, _, _ = study
    expected = {
        # run: (throughput scaling, memory avg scaling, parallel efficiency)
        "ddp-1n1g-5001": ("1", "1", "1"),            # the baseline: 1000.0 img/s, Avg 10000
        "ddp-1n2g-5002": ("1.9", "1.05", "0.95"),    # 1900/1000; 10500/10000; 1.9/2
        "ddp-1n4g-5010": ("3.6", "1.1", "0.9"),      # 3600/1000; 11000/10000; 3.6/4
        "ddp-2n4g-5004": ("6.8", "1.2", "0.85"),     # 6800/1000; 12000/10000; 6.8/(2x4)
        "ddp-4n4g-5005": ("12.8", "1.25", "0.8"),    # epoch 2: 12800/1000; 12500/10000; 12.8/16
        "dp-1n1g-5201": ("1", "1", "1"),             # the baseline: 800.0 img/s, Avg 9000
        "dp-1n2g-5202": ("1.5", "1.5", "0.75"),      # 1200/800; 13500/9000; 1.5/2
        "dp-1n4g-5203": ("2", "2", "0.5"),           # 1600/800; 18000/9000; 2.0/4
    }
    for run, (ts, ms, eff) in expected.items():
        r = rows[run]
        assert (r["throughput_scaling"], r["memory_avg_scaling"], r["parallel_efficiency"]) == (
            ts, ms, eff), run
    for run in ("ddp-1n2g-5002", "ddp-1n4g-5010", "ddp-2n4g-5004", "ddp-4n4g-5005"):
        assert rows[run]["baseline"] == "ddp-1n1g-5001"
    # fsdp's 1-GPU run failed: no factors for the others, and the CSV says why in the tables.
    for run in ("fsdp-1n2g-5102", "fsdp-1n4g-5103"):
        r = rows[run]
        assert (r["throughput_scaling"], r["memory_avg_scaling"], r["parallel_efficiency"],
                r["baseline"]) == ("", "", "", "")


def test_final_epoch_values_and_memory(study):
    rows, _, _ = study
    r = rows["ddp-1n2g-5002"]
    # The final line's values, as logged; epoch_time_s = 99968 images / 1900 img/s.
    assert (r["epoch"], r["epochs"], r["train_loss"], r["train_acc"], r["throughput_img_s"],
            r["epoch_time_s"], r["total_time_s"]) == (
        "3", "3", "3.698", "19.86", "1900", "52.61474", "1902.4")
    assert (r["world_size"], r["nodes"], r["gpus_per_node"], r["per_gpu_batch"],
            r["global_batch"], r["scaling"]) == ("2", "1", "2", "64", "128", "weak")
    # GPU 0: samples 9000 12000 10500 10500 -> Peak 12000, Avg 10500, Mode 10500.
    assert (r["gpu0"], r["gpu0_peak_mib"], r["gpu0_avg_mib"], r["gpu0_mode_mib"]) == (
        "gn02 GPU 0", "12000", "10500.0", "10500")
    # psrecord RSS samples 812 5120 5630 5631 -> Peak 5631, Avg 17193 / 4 = 4298.25.
    assert (r["cpu_node"], r["cpu_peak_rss_mib"], r["cpu_avg_rss_mib"]) == ("gn02", "5631.0",
                                                                          "4298.25")


def test_gpu0_is_the_first_nodes_and_spans_restarts(study):
    rows, md, _ = study
    r = rows["ddp-2n4g-5004"]
    # gn04 (first in NODELIST), its two logs together: 10000 14000 12000 12000 12000 12000
    # -> Peak 14000, Avg 72000/6 = 12000, Mode 12000. Either log alone gives another pair
    # (14000/14000 or 12000/12000), and gn05's GPU 0 is at 20000.
    assert (r["gpu0"], r["gpu0_peak_mib"], r["gpu0_avg_mib"], r["gpu0_mode_mib"]) == (
        "gn04 GPU 0", "14000", "12000.0", "12000")
    # CPU of gn04 over both attempts: Peak max(5120, 5310); Avg weighted by samples:
    # (2966.0 x 2 + 3800.0 x 3) / 5 = 3466.4
    assert (r["cpu_node"], r["cpu_peak_rss_mib"], r["cpu_avg_rss_mib"], r["restarts"]) == (
        "gn04", "5310.0", "3466.4", "1")
    # ... and so does its row in the multi-node table.
    assert ("| 2 Nodes x 4 GPUs | 3.698 | 19.86% | 6800.0 | 14000 | 12000.00 | 12000 | 6.80× | "
            "1.20× | 85% | ok |") in md


# --------------------------------------------------------------------------------------------
# Failed, partial, requeued, missing, skipped: never dropped
# --------------------------------------------------------------------------------------------

def test_every_run_has_a_row_with_its_status(study):
    rows, _, _ = study
    status = {run: r["status"] for run, r in rows.items()}
    assert status == {
        "ddp-1n1g-5001": "ok", "ddp-1n2g-5002": "ok", "ddp-1n4g-5003": "failed",
        "ddp-1n4g-5010": "ok", "ddp-2n4g-5004": "ok", "ddp-4n4g-5005": "partial",
        "ddp-8n4g": "missing", "fsdp-1n1g-5101": "failed", "fsdp-1n2g-5102": "ok",
        "fsdp-1n4g-5103": "requeued", "fsdp-2n4g": "failed", "fsdp-4n4g": "missing",
        "fsdp-8n4g": "missing", "dp-1n1g-5201": "ok",
        "dp-1n2g-5202": "ok", "dp-1n4g-5203": "ok", "dp-2n4g": "skipped", "dp-4n4g": "skipped",
        "dp-8n4g": "skipped"}
    assert rows["ddp-1n4g-5003"]["used_in_tables"] == "0"  # superseded by the --resume run
    assert rows["ddp-1n4g-5010"]["used_in_tables"] == "1"
    assert rows["ddp-1n4g-5003"]["exit_code"] == "1"
    assert rows["ddp-4n4g-5005"]["epoch"] == "2" and rows["ddp-4n4g-5005"]["exit_code"] == ""
    assert rows["fsdp-1n4g-5103"]["exit_code"] == "75"
    assert "no launch/job.sh" in rows["fsdp-2n4g"]["detail"]
    assert "fsdp-2n4g-5104.out" in rows["fsdp-2n4g"]["detail"]
    assert "job 5006" in rows["ddp-8n4g"]["detail"]
    assert "not run yet" in rows["fsdp-4n4g"]["detail"]
    assert "one node" in rows["dp-2n4g"]["detail"]


def test_tables_are_the_workshops_filled_in(study):
    _, md, _ = study
    seed_cols = ("| Config | Train Loss (Epoch 3) | Train Acc (Epoch 3) | Throughput (img/s) | "
                 "GPU 0 Peak (MiB) | GPU 0 Avg (MiB) | GPU 0 Mode (MiB) | ")
    assert md.count("### Multi-GPU Scaling (1 Node)") == 3  # dp, ddp, fsdp
    assert md.count("### Multi-Node Scaling (Fixed GPUs per Node)") == 3
    assert md.count(seed_cols + "Throughput Scaling vs 1G | Memory Avg Scaling vs 1G | "
                                "Parallel Efficiency | Status |") == 3
    assert md.count(seed_cols + "Throughput Scaling vs 1N | Memory Avg Scaling vs 1N | "
                                "Parallel Efficiency | Status |") == 2  # dp has none
    assert ("| 2 GPUs, 1 Node | 3.698 | 19.86% | 1900.0 | 12000 | 10500.00 | 10500 | 1.90× | "
            "1.05× | 95% | ok |") in md
    # partial: epoch 2's values, labelled as such, its throughput too (it was not)
    assert ("| 4 Nodes x 4 GPUs | 4.235 (epoch 2 of 3) | 12.44% (epoch 2 of 3) | "
            "12800.0 (epoch 2 of 3) | 13000 | "
            "12500.00 | 13000 | 12.80× | 1.25× | 80% | partial: 2/3 epochs done") in md
    assert "| 8 Nodes x 4 GPUs | — |" in md and "missing: submitted (job 5006)" in md
    # fsdp: the failed baseline and what that means for the others
    assert "| 1 GPU, 1 Node (baseline) | failed | failed | failed |" in md
    assert ("| 2 GPUs, 1 Node | 3.698 | 19.86% | 1800.0 | 7000 | 6500.00 | 6500 | "
            "no 1-GPU baseline | no 1-GPU baseline | no 1-GPU baseline | ok |") in md
    assert "requeued: exit code 75" in md
    assert "| 2 Nodes x 4 GPUs | failed | failed |" in md
    assert ("Skipped: 2 Nodes x 4 GPUs, 4 Nodes x 4 GPUs, 8 Nodes x 4 GPUs: DataParallel (dp) "
            "is one process on one node") in md
    assert "## DataParallel (dp): weak scaling, 64 images per GPU per step" in md
    assert "ddp-1n4g-5003: superseded in the tables by ddp-1n4g-5010 (ok)" in md


def test_unparseable_lines_are_counted_and_reported(study, capsys, tmp_path):
    rows, md, _ = study
    assert rows["ddp-1n2g-5002"]["bad_metric_lines"] == "1"
    assert rows["ddp-1n2g-5002"]["metric_lines"] == "3"  # incl. the one after rank 1's text
    assert "**1 [METRIC] line(s) could not be parsed**" in md
    assert "unparseable [METRIC] line at train.log:13: text without '='" in md
    collect_results.main([str(STUDY / "ddp-1n2g-5002"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "warning: 1 unparseable [METRIC] line(s)" in err
    assert "ddp-1n2g-5002/train.log:13:" in err


def test_killed_mid_write_and_no_newline(tmp_path):
    run = tmp_path / "ddp-1n1g-7001"
    shutil.copytree(STUDY / "ddp-1n1g-5001", run)
    env = (run / "job.env").read_text()
    (run / "job.env").write_text(env[:env.index("END_TIME")])  # killed: no EXIT_CODE
    log = run / "train.log"
    lines = log.read_text().splitlines()
    cut = next(i for i, ln in enumerate(lines) if "final=1" in ln)
    log.write_text("\n".join(lines[:cut]) + "\n" + lines[cut][:-12])  # the final line, cut off
    code, rows, md = collect([run], tmp_path / "out")
    r = rows["ddp-1n1g-7001"]
    assert code == 0
    assert (r["status"], r["epoch"], r["bad_metric_lines"]) == ("partial", "3", "1")
    assert "no EXIT_CODE in job.env" in r["detail"]
    assert "last line without its newline" in md


@pytest.mark.parametrize("damage, said", [
    (lambda final: re.sub(r"throughput_img_s=\S+", "throughput_img_s=abc", final),
     "'throughput_img_s=abc' is not a number"),
    # cut in a value and followed by a newline (a killed job's output, then the launcher's own
    # line): read as complete, throughput_img_s=1 for 1000, a 2-GPU run scaled 1000x against it
    (lambda final: final[:final.index("throughput_img_s=") + 18],
     "no peak_mem_mib=, which the line before had, nor what follows it")],
    ids=["not a number", "cut short"])
def test_an_unreadable_final_line_is_left_out_and_named(tmp_path, damage, said):
    """Before, throughput_img_s=abc in the final line gave a row of dashes with status ok (and
    the 2-GPU row no baseline), without a word; now the line is left out and named, and the
    row uses the last epoch line, as for any unreadable final line."""
    run = tmp_path / "ddp-1n1g-7002"
    shutil.copytree(STUDY / "ddp-1n1g-5001", run)
    log = run / "train.log"
    text = log.read_text()
    final = next(ln for ln in text.splitlines() if "final=1" in ln)
    log.write_text(text.replace(final, damage(final)))
    code, rows, md = collect([run], tmp_path / "out")
    r = rows["ddp-1n1g-7002"]
    assert (code, r["status"], r["bad_metric_lines"], r["throughput_img_s"]) == \
        (0, "ok", "1", "1000")
    assert "final [METRIC] line unreadable" in r["detail"]
    assert said in md


def test_a_study_with_no_run_yet_is_nothing_to_collect_and_a_deleted_local_run_is_named(
        tmp_path, capsys):
    """A study just submitted (study.json, no run directory) wrote a table without a number
    and exited 0, though --help promised exit 2 for nothing to collect. A local run whose
    directory was deleted said 'failed (ended before making its run directory: ... exit code
    0)', quoting its console output."""
    study = tmp_path / "study"
    study.mkdir()
    manifest = json.loads((STUDY / "study.json").read_text())
    (study / "study.json").write_text(json.dumps(manifest))
    assert collect_results.main([str(study), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    planned = len(manifest["runs"])
    assert err.startswith(f"error: nothing to collect yet: none of the study's {planned} runs "
                          f"has a run directory; dp-1n1g: submitted (job 5201) but no run "
                          f"directory yet"), err
    assert not (tmp_path / "out").exists()
    # a local study's run, made and then deleted (its console output is still there)
    entry = next(e for e in manifest["runs"] if e["name"] == "ddp-1n1g")
    entry["attempts"] = [{"job_id": "20261207-1", "exit_code": 0,
                          "output": str(study / "ddp-1n1g-20261207.out"),
                          "run_dir": str(study / "ddp-1n1g-20261207-1")}]
    (study / "study.json").write_text(json.dumps(manifest | {"mode": "local"}))
    (study / "ddp-1n1g-20261207.out").write_text("end : 2026-12-07 (exit code 0)\n")
    row = next(r for r in collect_results.read_study(study) if r["run"] == "ddp-1n1g")
    assert (row["status"], row["detail"]) == ("missing", (
        "its run directory ddp-1n1g-20261207-1 is not in the study any more (moved or "
        "deleted); put it back, or launch/run_benchmarks.py --resume runs it again"))
    # resumed after that, and failed before making a directory: the newest attempt's failure
    entry["attempts"].append({"job_id": "", "exit_code": 2,
                              "output": str(study / "ddp-1n1g-20261208.out")})
    (study / "study.json").write_text(json.dumps(manifest | {"mode": "local"}))
    (study / "ddp-1n1g-20261208.out").write_text("error: site settings site.sh, line 2\n")
    row = next(r for r in collect_results.read_study(study) if r["run"] == "ddp-1n1g")
    assert (row["status"], row["detail"]) == ("failed", (
        "ended before making its run directory: error: site settings site.sh, line 2 (see "
        "ddp-1n1g-20261208.out)"))


@pytest.mark.parametrize("rates, bad", [(("1000", "1500", "nan"), "ddp-1n4g-5010"),
                                         (("-1000", "1500", "3000"), "ddp-1n1g-5001"),
                                         (("inf", "1500", "3000"), "ddp-1n1g-5001"),
                                         (("0", "1500", "3000"), "ddp-1n1g-5001")])
def test_a_throughput_that_is_not_a_finite_positive_number_is_no_figure(tmp_path, rates, bad):
    """Before, a final line's throughput_img_s=nan gave "nan× | ... | nan%" with status ok, a
    1-GPU run at -1000 gave "-1.50×" and "-75%", one at inf "0.00×", and one at 0 "no 1-GPU
    baseline" with no word why. Now such a throughput is the tables' "—" with a note, never a
    baseline; results.csv keeps what the log said and leaves the factors empty."""
    runs = ("ddp-1n1g-5001", "ddp-1n2g-5002", "ddp-1n4g-5010")  # 1, 2 and 4 GPUs
    study = tmp_path / "study"
    for run, rate in zip(runs, rates):
        shutil.copytree(STUDY / run, study / run)
        log = study / run / "train.log"
        text = log.read_text()
        final = next(ln for ln in text.splitlines() if "final=1" in ln)
        log.write_text(text.replace(final, re.sub(r"throughput_img_s=\S+",
                                                  f"throughput_img_s={rate}", final)))
    code, rows, md = collect([study], tmp_path / "out")
    logged = dict(zip(runs, rates))[bad]
    assert (code, rows[bad]["status"], rows[bad]["throughput_img_s"]) == (0, "ok", logged)
    assert (rows[bad]["throughput_scaling"], rows[bad]["parallel_efficiency"]) == ("", "")
    table = [ln for ln in md.splitlines() if re.match(r"\| \d GPUs?, 1 Node", ln)]
    assert len(table) == 3 and not re.search(r"nan|inf|-\d", " ".join(table)), table
    cells = table[runs.index(bad)].split(" | ")
    assert (cells[3], cells[7], cells[9]) == ("—", "—", "—")  # throughput, scaling, efficiency
    assert f"- {bad}: throughput_img_s={logged} is not a finite number above 0" in md
    if bad == "ddp-1n1g-5001":  # never the baseline: the others have no factors, and why
        assert "not used as the 1-GPU baseline" in md
        assert {r["baseline"] for r in rows.values()} == {""}
        assert all(ln.count(report.NO_BASELINE) == 3 for ln in table[1:])
    else:
        assert (rows["ddp-1n2g-5002"]["throughput_scaling"], rows[bad]["baseline"]) == \
            ("1.5", "ddp-1n1g-5001")


def test_a_failed_run_without_train_log_says_so(tmp_path):
    """Not 'no final [METRIC] line ... see train.log' for a train.log that is not there."""
    run = tmp_path / "ddp-1n1g-7004"
    shutil.copytree(STUDY / "ddp-1n1g-5001", run)
    (run / "train.log").unlink()
    _code, rows, md = collect([run], tmp_path / "out")
    r = rows["ddp-1n1g-7004"]
    assert (r["status"], r["detail"]) == ("failed", "exit code 0; no train.log in the run "
                                                    "directory")
    assert md.count("no train.log") == 1  # said once, in the status


def test_cpu_runs_show_no_gpu_log(tmp_path):
    """A CPU run has no nvidia-smi log: GPU columns say so, CPU memory comes from psrecord."""
    run = tmp_path / "ddp-1n1g-7003"
    shutil.copytree(STUDY / "ddp-1n1g-5001", run)
    for f in (run / "gpu_memory").iterdir():
        f.unlink()
    code, rows, md = collect([run], tmp_path / "out")
    r = rows["ddp-1n1g-7003"]
    assert (r["gpu0"], r["gpu0_peak_mib"], r["cpu_peak_rss_mib"]) == ("n/a (no GPU log)", "",
                                                                     "5631.0")
    assert "| n/a (no GPU log) | n/a | n/a | 1.00× | n/a (no GPU log) | 100% | ok |" in md


@pytest.mark.parametrize("keys", ["today's", "before 2026-12-07"])
def test_memory_summary_json_when_logs_are_gone(tmp_path, keys):
    """A summary job.sh wrote before the CPU keys said MiB (peak_rss_mb: MiB all along) reads
    the same: the rename left its CPU memory blank, without a note."""
    run = tmp_path / "ddp-1n1g-7004"
    shutil.copytree(STUDY / "ddp-1n1g-5001", run)
    summary = subprocess.run([sys.executable, str(REPO / "analyze_memory.py"), "--json",
                              str(run)], capture_output=True, text=True, check=True).stdout
    if keys != "today's":
        summary = summary.replace('"peak_rss_mib"', '"peak_rss_mb"').replace(
            '"avg_rss_mib"', '"avg_rss_mb"')
    (run / "memory_summary.json").write_text(summary)
    shutil.rmtree(run / "gpu_memory")
    shutil.rmtree(run / "cpu_memory")
    _, rows, _ = collect([run], tmp_path / "out")
    r = rows["ddp-1n1g-7004"]
    assert (r["gpu0_avg_mib"], r["cpu_peak_rss_mib"]) == ("10000.0", "5631.0")
    assert float(r["cpu_avg_rss_mib"]) > 0


@pytest.mark.parametrize("summary", [
    '{"gpu": [{"node": "gn01"}], "cpu": []}',                # no GPU index: KeyError before
    '{"gpu": "abc", "cpu": []}',                             # TypeError before
    '{"gpu": [{"node": "gn01", "gpu": "x"}], "cpu": []}',    # ValueError (int()) before
    '{"gpu": [], "cpu": [{"node": "gn01", "peak_rss_mib": {}}]}',  # in the csv as "{}" before
    '[]'])
def test_a_damaged_memory_summary_json_is_a_note_and_the_run_is_collected(tmp_path, summary):
    run = tmp_path / "r1" / "run-1"
    run.mkdir(parents=True)
    for name in ("train.log", "job.env"):  # and no gpu_memory/ or cpu_memory/
        shutil.copy(STUDY / "ddp-1n1g-5001" / name, run)
    (run / "memory_summary.json").write_text(summary)
    code, rows, md = collect([run], tmp_path / "out")
    r = rows["run-1"]
    assert (code, r["status"], r["throughput_img_s"]) == (0, "ok", "1000")
    assert (r["gpu0"], r["gpu0_avg_mib"], r["cpu_peak_rss_mib"]) == ("n/a (no GPU log)", "", "")
    assert "- run-1: memory_summary.json unreadable (" in md and "no memory figures" in md


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

def test_plots_are_real_pngs(study):
    _, md, out = study
    for name in plots.PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 15_000, name  # axes, lines and labels, not an empty canvas
        assert f"]({name})" in md
    import matplotlib.image
    h, w, _ = matplotlib.image.imread(out / "throughput.png").shape
    assert (w, h) == (700, 450)  # figsize 7 x 4.5 at the default 100 dpi


# --------------------------------------------------------------------------------------------
# Bad input: one sentence, exit 2, no traceback
# --------------------------------------------------------------------------------------------

def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, str(REPO / "collect_results.py"), *map(str, args)],
                          capture_output=True, text=True, env=env_for_tests(), cwd=cwd or REPO,
                          timeout=300)


@pytest.mark.parametrize("case", ["missing", "empty dir", "a file", "out is a file",
                                  "bad manifest", "malformed manifest", "null attempts",
                                  "dpi 5000"])
def test_bad_input_is_one_clear_sentence(tmp_path, case):
    out = tmp_path / "out"
    if case == "missing":
        args, says = [tmp_path / "nope"], "no such file or directory"
    elif case == "empty dir":
        (tmp_path / "empty").mkdir()
        args, says = [tmp_path / "empty"], "no run directories"
    elif case == "a file":  # a log file is no input any more: its run directory is
        shutil.copytree(STUDY / "ddp-1n1g-5001", tmp_path / "run")
        args, says = [tmp_path / "run" / "train.log"], "pass a study directory"
    elif case == "out is a file":
        (tmp_path / "file").write_text("")
        # "cannot write to file (File exists); pass a writable --out DIR" named no fix
        args, says = [STUDY / "ddp-1n1g-5001", "--out", tmp_path / "file"], (
            f"--out {tmp_path / 'file'} is a file: name a folder for results.csv")
    elif case == "dpi 5000":  # before: minutes per plot, and PNGs of several MB
        args, says = [STUDY, "--plot", "--dpi", "5000"], "--dpi 5000 is out of range: use 50"
    else:
        study = tmp_path / "study"
        shutil.copytree(STUDY, study)
        (study / "study.json").write_text("{not json")
        if case in ("malformed manifest", "null attempts"):  # JSON, but attempts of ids, or
            manifest = json.loads((STUDY / "study.json").read_text())  # null: tracebacks before
            next(e for e in manifest["runs"] if e["name"] == "ddp-8n4g")["attempts"] = (
                ["5006"] if case == "malformed manifest" else None)
            (study / "study.json").write_text(json.dumps(manifest))
        args, says = [study], "not a study manifest"
    if case != "out is a file":
        args += ["--out", out]
    proc = _cli(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert not out.exists()


def test_a_failed_write_leaves_the_last_collection_as_it_was(tmp_path, capsys):
    """Before, results.csv was written in place before results.md: with a folder where
    results.md goes, the run said "cannot write" and exited 2, but results.csv already held
    the one run of the failed collection instead of the study's 19. Now every file is
    written beside the others first and moved into place only when all of them are."""
    out = tmp_path / "out"
    code, rows, _md = collect([STUDY], out)
    assert code == 0 and len(rows) == 19
    before = (out / "results.csv").read_bytes()
    (out / "results.md").unlink()
    (out / "results.md").mkdir()
    capsys.readouterr()
    assert collect_results.main([str(STUDY / "ddp-1n1g-5001"), "--out", str(out),
                                 "--plot"]) == 2
    assert (out / "results.csv").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.md"]  # no PNG,
    # no staging folder left behind
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "results.md" in err[0], err
    assert "move it away, or pass another --out DIR" in err[0]


def test_one_run_directory_of_a_study(tmp_path):
    """Given one run directory, its scaling mode still comes from the study's study.json, and
    the study's other planned runs are not listed as missing."""
    code, rows, md = collect([STUDY / "ddp-1n2g-5002"], tmp_path)
    assert code == 0 and list(rows) == ["ddp-1n2g-5002"]
    assert rows["ddp-1n2g-5002"]["scaling"] == "weak"
    assert "## DistributedDataParallel (ddp): weak scaling, 64 images per GPU per step" in md
    assert "| 1 GPU, 1 Node (baseline) | — |" in md  # not in what was collected


def test_a_run_directory_spelled_dot_keeps_its_name_and_study(tmp_path, monkeypatch):
    """Collected from inside it, "." is the run directory: Path(".").name is "" (an empty run
    column, timeline-.png) and Path(".").parent is "." (no study.json, no scaling mode)."""
    monkeypatch.chdir(STUDY / "ddp-1n2g-5002")
    code, rows, _md = collect(["."], tmp_path, "--plot")
    assert code == 0 and list(rows) == ["ddp-1n2g-5002"]
    assert rows["ddp-1n2g-5002"]["scaling"] == "weak"
    assert [p.name for p in tmp_path.glob("timeline-*")] == ["timeline-ddp-1n2g-5002.png"]


def test_a_link_to_a_run_in_the_study_is_that_run_once(tmp_path):
    """latest -> ddp-1n2g-5002 beside it: one row (it was two, one more ok run in the
    counts), named and found at the real folder, also when the link's name sorts first."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    (study / "a-latest").symlink_to("ddp-1n2g-5002")
    code, rows, _md = collect([study, study / "a-latest"], tmp_path / "out")
    lines = (tmp_path / "out" / "results.csv").read_text().splitlines()
    assert code == 0 and len(rows) == len(lines) - 1 == 19
    assert rows["ddp-1n2g-5002"]["path"] == str(study / "ddp-1n2g-5002")


def test_a_study_json_with_a_byte_order_mark_is_read(tmp_path):
    """A study.json saved again by an editor on Windows starts with a UTF-8 byte order mark:
    it was refused as "not a study manifest" (by run_benchmarks.py --resume too, which reads it
    with read_manifest)."""
    text = (STUDY / collect_results.MANIFEST).read_bytes()
    (tmp_path / collect_results.MANIFEST).write_bytes(b"\xef\xbb\xbf" + text)
    assert collect_results.read_manifest(tmp_path) == collect_results.read_manifest(STUDY)


def test_a_run_folder_name_that_is_not_utf8_is_written_as_its_bytes(tmp_path):
    """A run folder named with a Latin-1 byte (caf\\xe9): results.csv, results.md and the
    printed summary ended in a UnicodeEncodeError; the files now hold the name's own bytes."""
    study = tmp_path / "study"
    shutil.copytree(STUDY / "ddp-1n4g-5003", study / os.fsdecode(b"caf\xe9"))
    p = subprocess.run([sys.executable, str(REPO / "collect_results.py"), str(study)],
                       capture_output=True, text=True, timeout=120,
                       env=env_for_tests({"PYTHONIOENCODING": "utf-8:strict"}))
    assert p.returncode == 0, p.stderr
    assert "  caf\\udce9: failed" in p.stdout
    assert b"\ncaf\xe9,failed," in (study / "results.csv").read_bytes()
    assert b"caf\xe9/train.log" in (study / "results.md").read_bytes()


@pytest.mark.parametrize("loose", [True, False], ids=["and a loose run", "studies only"])
def test_a_folder_of_studies_is_refused_naming_them(tmp_path, capsys, loose):
    """Before, runs/ holding the studies study-cpu, lr-linear and lr-none and one run directory
    of launch/local.sh gave "1 runs: 1 ok" and exit 0: the loose run alone, without a word
    about the studies; with the studies alone it said "no run directories", naming none. A
    study's tables compare its own strategies and GPU counts, so it is one study at a time."""
    runs = tmp_path / "runs"
    for name in ("study-cpu", "lr-linear", "lr-none"):
        shutil.copytree(STUDY, runs / name)
    if loose:
        shutil.copytree(STUDY / "ddp-1n1g-5001", runs / "ddp-1n1g-4101")
    out = tmp_path / "out"
    assert collect_results.main([str(runs), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {runs} is no study but holds 3 "
                                               f"studies (lr-linear, lr-none, study-cpu)"), err
    assert "one study at a time" in err[0]
    assert f"python collect_results.py {runs / 'lr-linear'}" in err[0]
    assert (f"for the 1 run directory beside them, name it: python collect_results.py "
            f"{runs / 'ddp-1n1g-4101'}" in err[0]) == loose
    assert not captured.out and not out.exists()
    # what the sentence says to run works
    code, rows, _md = collect([runs / "lr-linear"], out)
    assert code == 0 and len(rows) == 19


def test_two_studies_named_together_are_refused(tmp_path, capsys):
    """Two study folders on one command line were merged without a word on the terminal:
    one study's 32-per-GPU runs scaled against the other's 16-per-GPU baseline."""
    one, two = tmp_path / "monday", tmp_path / "tuesday"
    for study in (one, two):
        shutil.copytree(STUDY, study)
    assert collect_results.main([str(one), str(two), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: {one} and {two} are two studies: collect one study at a "
                            f"time (a study's tables compare its own strategies and GPU "
                            f"counts): python collect_results.py {one}, then each other one, "
                            f"with its own --out if you give one\n")
    assert not captured.out and not (tmp_path / "out").exists()
    # one study named twice (a trailing slash, a link to it) is one study
    (tmp_path / "link").symlink_to(one)
    code, rows, _md = collect([one, f"{one}/", tmp_path / "link"], tmp_path / "out")
    assert code == 0 and len(rows) == 19
    # a study and a run directory of another folder are still one collection
    shutil.copytree(STUDY / "ddp-1n1g-5001", tmp_path / "other" / "ddp-1n1g-6001")
    code, rows, _md = collect([one, tmp_path / "other" / "ddp-1n1g-6001"], tmp_path / "out")
    assert code == 0 and len(rows) == 20 and rows["ddp-1n1g-6001"]["status"] == "ok"


def test_strong_scaling_heading_and_a_workload_mismatch(tmp_path):
    """A study recorded as strong scaling whose runs did not keep the global batch fixed (the
    fixture's runs are weak scaling: 64 per GPU) is labelled, and the mismatch is flagged."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    manifest = json.loads((study / "study.json").read_text())
    manifest["settings"].update(scaling="strong", per_gpu_batch=None, global_batch=256)
    for entry in manifest["runs"]:
        entry["scaling"] = "strong"
    (study / "study.json").write_text(json.dumps(manifest))
    code, rows, md = collect([study], tmp_path / "out")
    assert code == 0 and rows["ddp-1n2g-5002"]["scaling"] == "strong"
    assert ("## DistributedDataParallel (ddp): strong scaling, global batch "
            "64/128/256/512/1024 (per GPU: 64)") in md
    assert ("**Warning:** the runs differ in global_batch (64, 128, 256, 512, 1024): their "
            "scaling factors compare different workloads.") in md


_AS_NOBODY = """
import os, sys
sys.path.insert(0, sys.argv[1])
import collect_results
extra = sys.argv[6:]
collect_results.main([sys.argv[2], "--out", sys.argv[3], *extra])  # as root: every import done
os.setgroups([]); os.setgid(65534); os.setuid(65534)   # then as 'nobody', as a user would be
sys.exit(collect_results.main([sys.argv[4], "--out", sys.argv[5], *extra]))
"""


def test_an_unreadable_run_is_listed_and_the_others_collected():
    """A run directory another user made unreadable: PermissionError traceback and no results
    before; now that run is 'unreadable', naming the path, and every other run is collected,
    with --plot and --tensorboard too (which refused the whole study with "cannot write to
    OUT" before, while looking for the unreadable run's memory logs)."""
    import stat
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="unreadable-"))  # not under pytest's root-only tmp dir
    try:
        for name in ("plain", "study"):
            shutil.copytree(STUDY, top / name)
        os.chmod(top / "study" / "ddp-1n2g-5002", 0)  # nobody may list or enter it
        (top / "out").mkdir()
        for p in [top, *top.rglob("*")]:
            if p != top / "study" / "ddp-1n2g-5002" and not p.is_symlink():
                p.chmod(p.stat().st_mode | stat.S_IROTH | stat.S_IWOTH
                        | (stat.S_IXOTH if p.is_dir() else 0))
        extra = ["--plot", "--tensorboard"]
        if os.geteuid() == 0:
            cmd = [sys.executable, "-c", _AS_NOBODY, str(REPO), str(top / "plain"),
                   str(top / "plain-out"), str(top / "study"), str(top / "out"), *extra]
        else:
            cmd = [sys.executable, str(REPO / "collect_results.py"), str(top / "study"),
                   "--out", str(top / "out"), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        # the other runs' timelines are drawn; the unreadable one has none
        timelines = {p.name for p in (top / "out").glob("timeline-*.png")}
        assert "timeline-ddp-1n1g-5001.png" in timelines, sorted(timelines)
        assert "timeline-ddp-1n2g-5002.png" not in timelines
        with open(top / "out" / "results.csv", newline="") as f:
            rows = {r["run"]: r for r in csv.DictReader(f)}
        full = {r["run"]: r["status"] for r in collect_results.read_inputs([STUDY])}
        bad = rows["ddp-1n2g-5002"]
        assert bad["status"] == "unreadable" and "chmod -R a+rX" in bad["detail"], bad
        assert str(top / "study" / "ddp-1n2g-5002") in bad["detail"]
        assert {r: row["status"] for r, row in rows.items() if r != "ddp-1n2g-5002"} == \
            {r: status for r, status in full.items() if r != "ddp-1n2g-5002"}
        assert "unreadable" in (top / "out" / "results.md").read_text()
    finally:
        os.chmod(top / "study" / "ddp-1n2g-5002", 0o755)
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes the run folders another user's")
def test_tensorboard_into_run_folders_it_may_not_write_is_named_not_a_thread_traceback():
    """--tensorboard on a study another user owns: each run's TensorBoard writer failed in its
    own thread (five 'Exception in thread' tracebacks), and the exit was 0 with the failure only
    in results.md. Now each run is named in one line, the results are written, and it exits 1."""
    import stat
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="unwritable-"))  # not under pytest's root-only tmp dir
    try:
        for name in ("plain", "study"):
            shutil.copytree(STUDY, top / name)
        (top / "study" / "ddp-1n1g-5001" / "tensorboard").mkdir()  # the training's, say
        for p in [top, *top.rglob("*")]:  # readable by all, writable by root only
            p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
        (top / "out").mkdir(mode=0o777)
        (top / "out").chmod(0o777)
        proc = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(REPO), str(top / "plain"),
                               str(top / "plain-out"), str(top / "study"), str(top / "out"),
                               "--tensorboard"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr
        runs = [r for r in sorted(STUDY.iterdir()) if (r / "gpu_memory").is_dir()
                or (r / "cpu_memory").is_dir()]
        said = proc.stderr.splitlines()
        assert said[said.index(f"warning: --tensorboard could not write {len(runs)} run(s)' "
                               f"scalars:") + 1:] == [
            f"  {top / 'study' / r.name / 'tensorboard'}: cannot write (Permission denied); "
            f"make the run directory writable" for r in runs]
        assert (top / "out" / "results.csv").is_file()
        assert proc.stdout.count("TensorBoard:") == 1  # the root's run on "plain" only
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_cpu_study_is_labelled_in_processes_and_a_lone_point_has_no_ideal(tmp_path):
    """A CPU run's bar said '1 node x 2 GPUs'; throughput.png promised 'ideal linear scaling'
    for a study with one point and no ideal line."""
    run = tmp_path / "ddp-1n2g-1"
    run.mkdir()
    (run / "train.log").write_text(
        "[METRIC] strategy=ddp model=cnn dataset=synthetic device=cpu world_size=2 nodes=1 "
        "gpus_per_node=2 per_gpu_batch=32 global_batch=64 epoch=1 epochs=1 val_loss=1.5 "
        "val_acc=40 train_images=640 epoch_time_s=3 throughput_img_s=50 peak_mem_mib=10 "
        "data_wait_frac=0.1 final=1 total_time_s=4\n")
    (run / "job.env").write_text("EXIT_CODE=0\n")
    rows = collect_results.read_inputs([run])
    chosen = scaling.scale(rows)
    scaling.step_times(rows)
    _series, ideal, bars = report.plot_data(chosen)
    assert [label for label, _ in bars] == ["ddp, 1 node x 2 processes"]
    assert collect_results.main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "| 1 node x 2 processes | " in (tmp_path / "out" / "results.md").read_text()
    assert ideal == [] and "ideal" not in plots.throughput_title(ideal).split("(")[0]
    assert plots.throughput_title([("ddp", "x", [1, 2], [1, 2])]).endswith("linear scaling")


def test_the_memory_table_adds_up_to_its_predicted_peak(tmp_path):
    """The parts of a row summed to more than its predicted peak (dp: 107 against 103) with
    nothing to say why: the gradients that DataParallel and FSDP free before each step are
    starred, with the note, and the parts without a star add up to the peak."""
    out = tmp_path / "out"
    assert collect_results.main([str(STUDY), "--out", str(out)]) == 0
    text = (out / "results.md").read_text()
    table = text[text.index("## Where the memory goes"):].split("\n\n")[2].splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    starred = set()
    for line in table[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        parts = [cells[name] for name in head[1:head.index("Host")]]
        starred |= {cells["Config"].split(",")[0]} if cells["Grads"].endswith("*") else set()
        total = sum(float(c.replace(",", "")) for c in parts if c != "—" and not c.endswith("*"))
        assert abs(total - float(cells["Predicted peak"].replace(",", ""))) <= 1.5, cells
    assert starred == {"dp", "fsdp full"}
    assert report.GRADS_FREED_NOTE + "." in text


def test_a_collection_without_plot_says_the_earlier_plots_are_no_longer_in_results_md(
        tmp_path, capsys):
    """docs/slurm.md's step 4 (--tensorboard after step 3's --plot) rewrote results.md without
    its Plots section, in silence; the PNGs stayed, unlinked and of the earlier collection."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert collect_results.main([str(STUDY), "--out", str(out), "--plot"]) == 0
    assert "## Plots" in (out / "results.md").read_text() and "note:" not in \
        capsys.readouterr().out
    assert collect_results.main([str(STUDY), "--out", str(out)]) == 0
    assert f"note: {out / 'time_per_epoch.png'} and the other plots of an earlier --plot are " \
           f"not in results.md now" in capsys.readouterr().out
    assert "## Plots" not in (out / "results.md").read_text()


def test_a_log_axis_ends_on_labelled_ticks_around_every_point():
    """Autoscaled, throughput.png's lowest label (400) sat above its lowest points (320 img/s),
    and time_per_epoch.png's highest (1) below its highest (1.65 s)."""
    assert plots.log_limits([320, 333, 1930]) == (200, 2000)
    assert plots.log_limits([0.5, 1.65]) == (0.5, 2)
    assert plots.log_limits([155, 640]) == (100, 1000)
    assert plots.log_limits([50]) == (50, 100)  # one point on a tick: still a range
    # a damaged log's absurd figure: floats, not ints past numpy's int64 (a TypeError in
    # set_ylim, and no plot written), and no tick past the largest float
    assert plots.log_limits([320, 3e18]) == (200, 5e18)
    assert plots.log_limits([1e308]) == (1e308, 1e308)


def test_the_model_assumes_a_stated_settable_bandwidth_between_nodes_none_measured(tmp_path):
    """Only a one-node run measured the bus bandwidth: between nodes the model uses
    --inter-node-busbw (default: one 100 Gb/s link) and says so; the run's own count of its
    collectives sets the latency term."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    log = study / "ddp-1n2g-5002" / "train.log"
    log.write_text("[BANDWIDTH] op=all_reduce bytes=100000000 world_size=2 time_ms=5 "
                   "algbw_gbs=20 busbw_gbs=20.000 messages=3\n" + log.read_text())
    tables = {}
    for extra in ((), ("--inter-node-busbw", "1")):
        code, rows, md = collect([study], tmp_path / f"out{len(extra)}", *extra)
        assert code == 0
        tables[extra] = md
        assert "- bus bandwidth within a node: all_reduce 20 GB/s (measured by ddp-1n2g-5002, " \
               "1 node x 2)" in md
        assert "collectives per step: all_reduce 3 (counted by the run)" in md
    assert ("- between nodes: all_reduce 12 GB/s (assumed: no run measured it between nodes; "
            "--inter-node-busbw sets it); a ring across nodes runs at the slower of the two "
            "figures") in tables[()]
    assert "- between nodes: all_reduce 1 GB/s (assumed" in tables[("--inter-node-busbw", "1")]

    def at64(md):
        line = next(x for x in md.splitlines() if x.startswith("| 64 nodes x 4 GPUs | 256 |"))
        return float(line.split("|")[3])
    # slower links between nodes: a longer step at 64 nodes (less than the bytes' time alone
    # says: the carried overhead of the 4-node run is what the model did not explain, and a
    # slower link explains more of it)
    assert at64(tables[("--inter-node-busbw", "1")]) > at64(tables[()]) + 20


@pytest.mark.parametrize("flag", [["--inter-node-busbw", "0"], ["--ring-latency-us", "-1"],
                                  ["--inter-node-busbw", "nan"], ["--ring-latency-us", "inf"],
                                  ["--inter-node-busbw", "1e-300"]])
def test_a_bad_model_figure_is_one_sentence(tmp_path, flag, capsys):
    """inf and 1e-300 were taken: the model then said 'h = inf' and 100% efficiency at 256
    GPUs."""
    code, _rows, _md = collect([STUDY], tmp_path / "out", *flag)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --inter-node-busbw ") and ("the bandwidth must be 0.001 to "
                                                             "10000 GB/s") in err
    assert not (tmp_path / "out" / "results.csv").exists()


def test_an_empty_out_is_one_sentence_not_the_run_directory(tmp_path, capsys):
    """--out '' wrote results.* into the run directory given, as if --out were not there."""
    run = tmp_path / "run"
    shutil.copytree(STUDY / "ddp-1n1g-5001", run)
    assert collect_results.main([str(run), "--out", ""]) == 2
    assert capsys.readouterr().err == "error: --out '' names no folder: give one, or leave " \
                                      "--out out\n"
    assert not (run / "results.csv").exists()


@pytest.mark.parametrize("measured, carried, hidden", [
    (150.0, 50.0, 2 / 3),      # slower than the model: the difference is carried
    (90.0, -10.0, 18.06 / 100),  # faster than t1: every byte hidden, the rest carried
])
def test_the_model_agrees_with_the_largest_run_it_measured(measured, carried, hidden):
    def row(nodes, per_node, step, **extra):
        return dict(run=f"ddp-{nodes}n{per_node}g", nodes=str(nodes), gpus_per_node=str(per_node),
                    step_ms=str(step), predicted_step_ms="", **extra)
    configs = {(1, 1): row(1, 1, 100.0),
               (2, 4): row(2, 4, measured, grad_bytes="100000000", busbw_all_reduce_gbs="10",
                           messages_all_reduce="4")}
    inputs, why = scaling.model_inputs((1, "ddp", "weak"), configs)
    assert why == "" and inputs["anchor"] is configs[(2, 4)]
    # 2 x 7/8 x 100 MB / 10 GB/s + 4 x 2 x 7 x 10 us = 18.06 ms of communication
    assert inputs["carried"] == pytest.approx(carried)
    assert inputs["hidden"] == pytest.approx(hidden)
    assert scaling.predict_step_ms(inputs, 2, 4) == pytest.approx(measured)
    # 64 nodes: 2 x 255/256 x 10 + 4 x 2 x 255 x 0.01 = 40.32 ms, 2/3 x 100 ms hides it all
    if carried > 0:
        assert scaling.predict_step_ms(inputs, 64, 4) == pytest.approx(150.0)


# --------------------------------------------------------------------------------------------
# Where the memory goes: the runs' [MEMORY] lines beside their measured peaks
# --------------------------------------------------------------------------------------------

def test_where_the_memory_goes_sets_each_prediction_beside_its_peak(study):
    rows, md, out = study
    section = md.split("## Where the memory goes", 1)[1].split("\n## ", 1)[0]
    r = rows["ddp-1n2g-5002"]
    predicted, measured = float(r["predicted_peak_mib"]), float(r["peak_mem_mib"])
    assert float(r["memory_error"]) == pytest.approx(predicted / measured - 1, abs=1e-4)
    assert r["predicted_variant"] == "-" and float(r["predicted_activations_mib"]) > 0
    # one table row per chosen run that predicted, in the tables' order: dp 1, 2, 4 GPUs, ddp
    # 1, 2, 4, 8, fsdp 2
    table = [line for line in section.splitlines() if line.startswith("| ") and "Config" not in
             line]
    assert [line.split(" | ")[0] for line in table] == [
        "| dp, 1 node x 1 GPU", "| dp, 1 node x 2 GPUs", "| dp, 1 node x 4 GPUs",
        "| ddp, 1 node x 1 GPU", "| ddp, 1 node x 2 GPUs", "| ddp, 1 node x 4 GPUs",
        "| ddp, 2 nodes x 4 GPUs", "| fsdp full, 1 node x 2 GPUs"]
    cells = table[4].split(" | ")
    assert cells[-2:] == [f"{measured:,.0f}", f"{predicted / measured - 1:+.0%} |"]
    assert "ddp, 4 nodes" not in section  # its log has no [MEMORY] line: left out, not guessed
    assert "memory_breakdown.png" in md
    assert (out / "memory_breakdown.png").read_bytes()[:8] == PNG_MAGIC


def _one_run_study(tmp_path, memory_sizes: str, device: str, peak: float) -> tuple:
    """A study of one run whose log has a [MEMORY] line with ``memory_sizes`` (its sizes, as
    a version of the scripts printed them) and a final [METRIC] line; collect()'s result."""
    run = tmp_path / "ddp-1n1g-1"
    run.mkdir()
    (run / "train.log").write_text(
        "[MEMORY] strategy=ddp variant=- world_size=1 per_gpu_batch=16 image_size=32 amp=off "
        "params_mib=2.1 grads_mib=2.1 optimizer_mib=2.1 buffers_mib=0 amp_copies_mib=0 "
        f"activations_mib=3.5 comm_mib=0 {memory_sizes}\n"
        f"[METRIC] strategy=ddp model=cnn dataset=synthetic device={device} world_size=1 "
        "nodes=1 gpus_per_node=1 epoch=1 epochs=1 val_loss=1.5 val_acc=40 epoch_time_s=3 "
        f"throughput_img_s=50 peak_mem_mib={peak} final=1 total_time_s=4\n")
    (run / "job.env").write_text("EXIT_CODE=0\n")
    return collect([run], tmp_path / "out")


def test_a_cpu_runs_peak_is_not_compared_with_the_prediction(tmp_path):
    code, rows, md = _one_run_study(tmp_path, "transient_mib=0.5 host_mib=0 peak_mib=10.3",
                                    "cpu", 410)
    assert code == 0 and rows["ddp-1n1g-1"]["memory_error"] == ""
    # an older [MEMORY] line, without workspace_mib, data_mib and inputs_mib: read, those
    # cells empty, and its backward transient in a column of its own
    assert rows["ddp-1n1g-1"]["predicted_data_mib"] == ""
    assert "| Comm. buffers | Workspace | Backward transient (older runs) | Data on GPU |" in md
    assert "| ddp, 1 node x 1 process | 2 | 2 | 2 | 0 | 0 | 4 | 0 | — | 0 | — | — | 0 | 10 | " \
        "410 (RSS) | n/a |" in md


def test_the_data_and_input_batches_of_a_memory_line_are_read(tmp_path):
    code, rows, md = _one_run_study(
        tmp_path, "transient_mib=0.5 data_mib=6.2 inputs_mib=0.1 host_mib=0 peak_mib=16.6",
        "cuda", 17)
    r = rows["ddp-1n1g-1"]
    assert code == 0 and (r["predicted_data_mib"], r["predicted_inputs_mib"]) == ("6.2", "0.1")
    assert "| Data on GPU | Input batches |" in md
    assert "| ddp, 1 node x 1 GPU | 2 | 2 | 2 | 0 | 0 | 4 | 0 | — | 0 | 6 | 0 | 0 | 17 | 17 |" in md


def test_a_memory_line_with_the_workspace_is_read_without_a_transient_column(tmp_path):
    """Since 2026-11-28 a [MEMORY] line has the measured workspace and no backward transient:
    the table has no column for a part none of its runs has."""
    code, rows, md = _one_run_study(
        tmp_path, "workspace_mib=86.0 data_mib=6.2 inputs_mib=0.1 host_mib=0 peak_mib=102.1",
        "cuda", 100)
    r = rows["ddp-1n1g-1"]
    assert code == 0 and (r["predicted_workspace_mib"], r["predicted_transient_mib"]) == (
        "86.0", "")
    assert "| Comm. buffers | Workspace | Data on GPU |" in md and "transient" not in md
    # results.csv: every size any line version has, the older transient beside the workspace
    assert set(contract.READ_MEMORY_SIZE_KEYS) == set(contract.MEMORY_SIZE_KEYS
                                                      + contract.EARLIER_MEMORY_KEYS)
    head = (tmp_path / "out" / "results.csv").read_text().splitlines()[0].split(",")
    assert head.index("predicted_workspace_mib") + 1 == head.index("predicted_transient_mib") \
        < head.index("predicted_peak_mib")
    assert "| ddp, 1 node x 1 GPU | 2 | 2 | 2 | 0 | 0 | 4 | 0 | 86 | 6 | 0 | 0 | 102 | 100 | " \
        "+2% |" in md


def test_a_study_that_cannot_be_read_at_all_is_one_sentence_and_exit_2():
    """Before: a study folder another user's, read with --out, gave "1 runs: 1 unreadable"
    and exit 0, as if results had been written."""
    import stat
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="unreadable-"))  # not under pytest's root-only tmp dir
    try:
        shutil.copytree(STUDY, top / "plain")
        shutil.copytree(STUDY, top / "study")
        (top / "out").mkdir()
        for p in [top, *top.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | stat.S_IROTH | stat.S_IWOTH
                        | (stat.S_IXOTH if p.is_dir() else 0))
        os.chmod(top / "study", 0o700)  # its owner's only
        if os.geteuid() == 0:
            cmd = [sys.executable, "-c", _AS_NOBODY, str(REPO), str(top / "plain"),
                   str(top / "plain-out"), str(top / "study"), str(top / "out")]
        else:
            os.chmod(top / "study", 0)
            cmd = [sys.executable, str(REPO / "collect_results.py"), str(top / "study"),
                   "--out", str(top / "out")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert errors == [
            f"error: cannot read {top / 'study'} (Permission denied): run as a user who may "
            f"read it, or make it readable (chmod -R a+rX {top / 'study'})"], proc.stderr
        assert " unreadable" not in proc.stdout and not list((top / "out").iterdir())
    finally:
        os.chmod(top / "study", 0o755)
        shutil.rmtree(top, ignore_errors=True)
