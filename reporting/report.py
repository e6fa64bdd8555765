"""A scaling study's report: results.md (the workshop's tables per strategy, where the step time
goes, the scaling model beyond the study) and, with --plot, the study's PNGs.

Made from the rows alone: collect_results.py reads them, scaling.py adds the factors and the
predictions, plots.py draws what plot_data hands it.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

from training import contract
from reporting import plots, stragglers
from reporting.scaling import (FAILED, HAS_METRICS, OK, OVERLAP, SKIPPED, STATUSES,
                               beyond_study, gpus, group_of, num, predict_step_ms, throughput)

STRATEGY_TITLE = {"dp": "DataParallel (dp)", "ddp": "DistributedDataParallel (ddp)",
                  "fsdp": "FSDP (fsdp)"}
NO_BASELINE = "no 1-GPU baseline"


# --------------------------------------------------------------------------------------------
# results.md: the workshop's two tables per strategy
# --------------------------------------------------------------------------------------------

def _fmt(row: dict, key: str, spec: str, unit: str = "") -> str:
    value = num(row, key)
    return "—" if value is None else f"{value:{spec}}{unit}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + (("es" if what.endswith("s") else "s") if n != 1 else "")


def epoch_tag(row: dict) -> str:
    """" (epoch E of N)" for a run whose figures are not its final epoch's (a partial run's
    last complete epoch), else ""."""
    epoch, epochs = row.get("epoch"), row.get("epochs")
    return f" (epoch {epoch} of {epochs})" if epoch and epochs and epoch != epochs else ""


def table_row(label: str, row: dict | None) -> list:
    """One table row: the workshop's columns, then parallel efficiency and status."""
    if row is None:
        return [label] + ["—"] * 9 + ["not in this study"]
    status = row["status"] + (f": {row['detail']}" if row["detail"] else "")
    if row["status"] not in HAS_METRICS or num(row, "throughput_img_s") is None:
        return [label] + [FAILED if row["status"] == FAILED else "—"] * 9 + [status]
    tag = epoch_tag(row)  # on every figure of the run: its throughput is that epoch's too
    gpu = [row["gpu0"], "n/a", "n/a"]
    if row["gpu0_peak_mib"] != "":
        gpu = [str(row["gpu0_peak_mib"]), _fmt(row, "gpu0_avg_mib", ".2f"),
               str(row["gpu0_mode_mib"])]
    factors = [NO_BASELINE] * 3
    if row["baseline"]:
        memory = _fmt(row, "memory_avg_scaling", ".2f", "×")
        if memory == "—":  # say why
            memory = row["gpu0"] if row["gpu0_avg_mib"] == "" else "n/a (baseline: no GPU log)"
        factors = [_fmt(row, "throughput_scaling", ".2f", "×"), memory,
                   _fmt(row, "parallel_efficiency", ".0%")]
    rate = throughput(row)  # a nan, inf, 0 or negative one is no figure (the notes say why)
    if rate is None:
        factors[0] = factors[2] = "—"
    return [label, _fmt(row, "train_loss", ".3f") + tag, _fmt(row, "train_acc", ".2f", "%") + tag,
            "—" if rate is None else f"{rate:.1f}{tag}", *gpu, *factors, status]


def _table(vs: str, epochs: str, labelled_rows: list) -> list:
    ep = f"Epoch {epochs}" if epochs else "final epoch"
    header = ["Config", f"Train Loss ({ep})", f"Train Acc ({ep})", "Throughput (img/s)",
              "GPU 0 Peak (MiB)", "GPU 0 Avg (MiB)", "GPU 0 Mode (MiB)",
              f"Throughput Scaling vs {vs}", f"Memory Avg Scaling vs {vs}",
              "Parallel Efficiency", "Status"]
    rows = [table_row(label, row) for label, row in labelled_rows]
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows])


def _distinct(rows: list, key: str) -> list:
    """The distinct values of a key, numbers in numeric order."""
    def order(value: str) -> tuple:
        n = num({key: value}, key)
        return (n is None, n or 0.0, value)
    return sorted({str(r[key]) for r in rows if r.get(key) not in (None, "")}, key=order)


def strategy_markdown(key: tuple, configs: dict, rows: list) -> list:
    """A strategy's heading, its workload, and the workshop's two tables."""
    _order, strategy, scaling = key
    members = [r for r in rows if group_of(r) == key]
    logged = [r for r in members if r["status"] in HAS_METRICS and r["metric_lines"]]

    def values(k, rows=logged):
        return "/".join(_distinct(rows, k))

    per_gpu = values("per_gpu_batch") or values("per_gpu_batch", members) or "?"
    global_ = values("global_batch") or values("global_batch", members) or "?"
    mode = {"weak": f"weak scaling, {per_gpu} images per GPU per step",
            "strong": f"strong scaling, global batch {global_} (per GPU: {per_gpu})"}.get(
        scaling, "scaling mode not recorded (no study.json)")
    lines = [f"## {STRATEGY_TITLE.get(strategy, strategy or 'unknown strategy')}: {mode}", ""]
    context = [f"{k} {values(k)}" for k in ("model", "dataset", "device", "amp") if values(k)]
    context += [f"{values('epochs')} epochs"] if values("epochs") else []
    if values("lr_peak"):  # the learning rate each run trained with, and why
        context.append(f"learning rate {values('lr_peak')} (lr scaling "
                       f"{values('lr_scaling') or 'none'}, warm-up "
                       f"{values('warmup_epochs') or '0'} epochs)")
    if _distinct(logged, "transport"):  # the networks of the runs that measured theirs
        context.append("collectives over " + " and ".join(_distinct(logged, "transport")))
    if context:
        lines.append(", ".join(context) + ".")
    if values("device") == "cpu":
        lines.append("CPU run: each \"GPU\" below is one process; there is no GPU memory log, "
                     "so CPU memory (psrecord) is in results.csv.")
    fixed = {"weak": ("per_gpu_batch",), "strong": ("global_batch",)}.get(scaling, ())
    for k in ("model", "dataset", "epochs") + fixed:
        if len(_distinct(logged, k)) > 1:
            lines.append(f"**Warning:** the runs differ in {k} ({', '.join(_distinct(logged, k))}"
                         f"): their scaling factors compare different workloads.")
    epochs = values("epochs") if len(_distinct(logged, "epochs")) == 1 else ""
    shown = {c: r for c, r in configs.items() if r["status"] != SKIPPED}

    def skipped(multi_node: bool) -> list:
        names = [c for c in sorted(configs) if configs[c]["status"] == SKIPPED
                 and (c[0] > 1) == multi_node]
        listed = ", ".join(f"{_count(n, 'Node')} x {_count(g, 'GPU')}" for n, g in names)
        return ["", f"Skipped: {listed}: {configs[names[0]]['detail']}."] if names else []

    lines += ["", "### Multi-GPU Scaling (1 Node)", ""]
    single = sorted(g for (n, g) in shown if n == 1)
    if single:
        labelled = [(f"{_count(g, 'GPU')}, 1 Node" + (" (baseline)" if g == 1 else ""),
                     shown[(1, g)]) for g in single]
        if 1 not in single:
            labelled.insert(0, ("1 GPU, 1 Node (baseline)", None))
        lines += _table("1G", epochs, labelled)
    else:
        lines.append("No single-node runs in this study.")
    lines += skipped(False) + ["", "### Multi-Node Scaling (Fixed GPUs per Node)", ""]
    sweeps = sorted({g for (n, g) in shown if n > 1})
    if sweeps:
        labelled = [("1 Node, 1 GPU (baseline)", shown.get((1, 1)))]
        labelled += [(f"{_count(n, 'Node')} x {_count(g, 'GPU')}", shown[(n, g)])
                     for g in sweeps for n in sorted(n for (n, gg) in shown if gg == g)
                     if (n, g) != (1, 1)]
        lines += _table("1N", epochs, labelled)
        lines += ["", "1N = the 1-GPU, 1-node baseline run (as in the workshop), so both "
                      "tables compare with the same run; the 1-node rows show where each node "
                      "sweep starts."]
    else:
        lines.append("No multi-node runs in this study.")
    return lines + skipped(True) + [""]


def _ms(row: dict | None, key: str) -> str:
    return "—" if row is None or num(row, key) is None else f"{num(row, key):.1f}"


def explain_markdown(key: tuple, configs: dict, model: tuple) -> list:
    """Why a group does not scale perfectly: each run's step split into its parts, then the
    scaling model's prediction beyond the study (``model``: scaling.predict's (inputs, why not)
    for this group)."""
    shown = [(c, r) for c, r in sorted(configs.items()) if num(r, "step_ms") is not None]
    if not shown:
        return []
    lines = ["### Where the step time goes", "",
             "Step and data wait: ms per training step of the final epoch (data wait: the loader "
             "kept the step waiting). Where profiled, the steps `--profile` traced early in the "
             "run, under the profiler, so their step is not the final epoch's: their step and "
             "its parts, which add up to it: compute, exposed communication (not hidden behind "
             "compute), data wait and other; beside them all communication, hidden or not.", "",
             "| Config | Step | Data wait | Profiled step | Compute | Exposed comm. | "
             "Profiled data wait | Other | Comm. total | Bus bandwidth (GB/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (nodes, g), r in shown:
        profiled = num(r, "profile_step_ms") is not None
        parts = ([_ms(r, f"profile_{k}_ms") for k in ("step", "compute", "exposed_comm",
                                                      "data_wait", "other", "comm")]
                 if profiled else ["not profiled"] + ["—"] * 5)
        bw = ", ".join(f"{op} {r[f'busbw_{op}_gbs']}" for op in
                       ("all_reduce", "all_gather", "reduce_scatter") if r[f"busbw_{op}_gbs"])
        if bw and r.get("transport"):  # which network carried it (a log from before: unsaid)
            bw += f" over {r['transport']}"
        unit = "process" if r.get("device") == "cpu" else "GPU"  # a CPU run has no GPUs
        lines.append(f"| {_count(nodes, 'node')} x {_count(g, unit)} | "
                     f"{_ms(r, 'step_ms')}{epoch_tag(r)} | "
                     f"{_ms(r, 'data_wait_ms')} | " + " | ".join(parts) + f" | {bw or '—'} |")
    inputs, why = model
    if key[1] not in OVERLAP:  # DataParallel: one process, nothing to model
        return lines + [""]
    lines += ["", "### Scaling model: beyond this study", ""]
    if not inputs:
        return lines + [why + ".", ""]
    return lines + model_markdown(inputs, configs)


def _bandwidth(busbw: dict, source: dict | None, where: str) -> str:
    figures = ", ".join(f"{op} {v:g} GB/s" for op, v in busbw.items())
    if source is None:
        return f"{figures} (assumed: no run measured it {where}; --inter-node-busbw sets it)"
    return (f"{figures} (measured by {source['run']}, "
            f"{_count(int(num(source, 'nodes')), 'node')} x {int(num(source, 'gpus_per_node'))})")


def model_markdown(inputs: dict, configs: dict) -> list:
    """The model's inputs, each with where it came from, and its table to 64 nodes."""
    strategy, t1, anchor = inputs["strategy"], inputs["t1"], inputs["anchor"]
    node = (_bandwidth(inputs["busbw_node"], inputs["node_source"], "within a node")
            if inputs["node_source"] else "as between nodes (no one-node run measured it)")
    messages = ", ".join(f"{op} {v:g}" for op, v in inputs["messages"].items())
    messages += (" (counted by the run)" if inputs["messages_counted"] else
                 " (assumed: the run did not count them; " + (
                     "DDP's default 25 MiB buckets)" if strategy == "ddp" else
                     "one unit per 25 MiB of gradients)"))
    comm = ("2(N-1)/N x G / busbw(all_reduce) + buckets x 2(N-1) x a" if strategy == "ddp" else
            "gathers x (N-1)/N x G / busbw(all_gather) + (N-1)/N x G / busbw(reduce_scatter) "
            "+ messages x (N-1) x a")
    h, usual = inputs["hidden"], OVERLAP[strategy]
    hidden = f"{h:.2f} (the share of a step communication can hide behind)"
    if anchor is None:
        carried = "none: no multi-GPU run measured"
    elif h != usual:
        step = predict_step_ms(dict(inputs, hidden=usual, carried=0.0),
                               int(num(anchor, "nodes")), int(num(anchor, "gpus_per_node")))
        hidden = (f"{h:.2f}, fitted: the study's largest run, {anchor['run']}, took "
                  f"{num(anchor, 'step_ms'):.1f} ms a step{epoch_tag(anchor)}, less than the "
                  f"{step:.1f} ms that "
                  f"h = {usual:.2f} gives, so compute hid more of its communication")
        carried = f"{inputs['carried']:.1f} ms" + (
            "" if inputs["carried"] == 0 else " (that run was faster than t1 itself)")
    else:
        explained = num(anchor, "step_ms") - inputs["carried"]
        carried = (f"{inputs['carried']:.1f} ms: the study's largest run, {anchor['run']}, "
                   f"took {num(anchor, 'step_ms'):.1f} ms a step{epoch_tag(anchor)} and the "
                   f"model explains "
                   f"{explained:.1f} ms of it")
    lines = [f"step(N) = t1 + max(0, comm(N) - h x t1) + carried, comm(N) = {comm}; efficiency "
             f"= t1 / step(N). See docs/slurm.md, \"A scaling model\".", "",
             f"- t1 = {t1:.1f} ms (the 1-GPU run{epoch_tag(configs[(1, 1)])}); G = {inputs['grad_bytes'] / 1e6:.1f} MB "
             f"(fp32 gradients); h = {hidden}",
             f"- bus bandwidth within a node: {node}",
             "- between nodes: " + _bandwidth(inputs["busbw_inter"], inputs["inter_source"],
                                              "between nodes")
             + "; a ring across nodes runs at the slower of the two figures",
             f"- collectives per step: {messages}; a = {inputs['latency_us']:g} us per ring "
             f"step (--ring-latency-us)",
             f"- carried overhead: {carried}", "",
             "| Config | GPUs | Predicted step (ms) | Predicted efficiency | Measured step (ms) "
             "| Error |", "|---|---|---|---|---|---|"]
    unit = "process" if configs[(1, 1)].get("device") == "cpu" else "GPU"
    for nodes, g, step, r in beyond_study(inputs, configs):
        error = "—" if r is None else f"{num(r, 'prediction_error'):+.0%}"
        if r is not None and r is anchor:
            error += " (the model is fitted here)"
        lines.append(f"| {_count(nodes, 'node')} x {_count(g, unit)} | {nodes * g} | "
                     f"{step:.1f} | {t1 / step:.0%} | {_ms(r, 'step_ms')} | {error} |")
    return lines + [""]


# --------------------------------------------------------------------------------------------
# Where the memory goes: each run's predicted components beside its measured peak
# --------------------------------------------------------------------------------------------

#: The predicted components, in the order they stack (results.md and memory_breakdown.png).
MEMORY_PARTS = {"params": "Params", "grads": "Grads", "optimizer": "Optimizer",
                "buffers": "Buffers", "amp_copies": "AMP copies",
                "activations": "Activations", "comm": "Comm. buffers",
                "workspace": "Workspace", "transient": "Backward transient (older runs)",
                "data": "Data on GPU", "inputs": "Input batches"}
# Parts of older [MEMORY] lines only (contract.EARLIER_MEMORY_KEYS): a column where a run has one.
EARLIER_PARTS = tuple(k.removesuffix("_mib") for k in contract.EARLIER_MEMORY_KEYS)


def memory_parts(found: list) -> dict:
    """MEMORY_PARTS, without the older lines' parts that none of ``found``'s runs has."""
    return {k: name for k, name in MEMORY_PARTS.items()
            if k not in EARLIER_PARTS or any(num(r, f"predicted_{k}_mib") is not None
                                             for _, r in found)}


def grads_in_peak(r: dict) -> float:
    """The MiB of gradients resident at a run's predicted peak: all of them, or none where they
    are freed before each step and made during backward (DataParallel, FSDP, DDP without
    gradient_as_bucket_view), as the activations are freed: the peak less every other part
    (the [MEMORY] line's peak is the sum of the parts resident at once)."""
    others = sum(num(r, f"predicted_{k}_mib") or 0.0 for k in MEMORY_PARTS if k != "grads")
    return max(0.0, num(r, "predicted_peak_mib") - others)


def grads_freed(r: dict) -> bool:
    """Whether the run's gradients are left out of its predicted peak (grads_in_peak)."""
    return grads_in_peak(r) < (num(r, "predicted_grads_mib") or 0.0) - 0.5


GRADS_FREED_NOTE = ("*: not in the predicted peak: the gradients are freed before each step and "
                    "made during backward, as the activations are freed (`--estimate-memory` "
                    "marks them the same way)")


def memory_rows(chosen: dict) -> list:
    """(label, row) of every chosen run that predicted its memory, in table order."""
    found = []
    for key in sorted(chosen):
        for (n, g), r in sorted(chosen[key].items()):
            if num(r, "predicted_peak_mib") is None:
                continue
            variant = r.get("predicted_variant") or "-"
            unit = "process" if r.get("device") == "cpu" else "GPU"
            found.append((f"{key[1]}{'' if variant == '-' else ' ' + variant}, "
                          f"{_count(n, 'node')} x {_count(g, unit)}", r))
    return found


def memory_markdown(chosen: dict) -> list:
    """results.md's "Where the memory goes": per run, the predicted MiB per GPU by component,
    the predicted peak, the measured one, and the error."""
    found = memory_rows(chosen)
    lines = ["## Where the memory goes", ""]
    if not found:
        return lines + ["No run in this study printed a [MEMORY] line (its training scripts "
                        "predate the memory model).", ""]
    lines += ["MiB per GPU (GPU 0 for DataParallel), predicted by each run at its start from the "
              "model and the flags (its [MEMORY] line; `python ddp_train.py --estimate-memory` "
              "prints the same before a job). Activations: every tensor the forward saves for "
              "backward, counted on the CPU; comm. buffers: DDP's gradient buckets, FSDP's "
              "gathered blocks, DataParallel's whole batch on GPU 0; workspace: cuBLAS's and "
              "cuDNN's workspaces and the backward's temporaries, measured once on an H200. "
              "Measured: the run's peak "
              "(`torch.cuda.max_memory_allocated`, the largest over its GPUs). Not counted: "
              "allocator fragmentation, the CUDA context (about 0.5 GB more in nvidia-smi's "
              "GPU 0 Peak).", ""]
    parts = memory_parts(found)
    head = ["Config", *parts.values(), "Host", "Predicted peak", "Measured peak", "Error"]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    cpu = False
    for label, r in found:
        cells = [_fmt(r, f"predicted_{k}_mib", ",.0f") + ("*" if k == "grads" and grads_freed(r)
                                                          else "")
                 for k in (*parts, "host", "peak")]
        if r.get("device") == "cpu":
            cpu = True
            measured, error = _fmt(r, "peak_mem_mib", ",.0f") + " (RSS)", "n/a"
        else:
            measured, error = _fmt(r, "peak_mem_mib", ",.0f"), _fmt(r, "memory_error", "+.0%")
        lines.append("| " + " | ".join([label, *cells, measured, error]) + " |")
    if any(grads_freed(r) for _, r in found):
        lines += ["", GRADS_FREED_NOTE + "."]
    if cpu:
        lines += ["", "(RSS): a CPU run's measured peak is its process's resident memory: the "
                      "interpreter, torch's libraries and the data beside the model, no GPU "
                      "memory to compare with the prediction."]
    return lines + [""]


def write_markdown(rows: list, chosen: dict, models: dict, studies: list, path: Path,
                   pngs: list) -> None:
    counts = ", ".join(f"{n} {s}" for s in STATUSES if (n := [r["status"] for r in rows].count(s)))
    bad = sum(len(r["bad"]) for r in rows)
    lines = ["# Scaling study results", "",
             f"Collected from {', '.join(f'`{s}`' for s in studies)} on "
             f"{datetime.now():%Y-%m-%d %H:%M} by `python collect_results.py`: {len(rows)} runs "
             f"({counts}).", "",
             "Values are from each run's final epoch. Throughput Scaling = throughput / "
             "throughput of the same strategy's 1-GPU, 1-node run; Memory Avg Scaling = GPU 0 "
             "Avg / its GPU 0 Avg (GPU 0 = index 0 on the job's first node); Parallel "
             "Efficiency = Throughput Scaling / GPUs. All columns, CPU memory and every "
             "attempt are in results.csv.", ""]
    if bad:
        lines += [f"**{bad} [METRIC] line(s) could not be parsed** and were left out; they are "
                  f"listed under Notes.", ""]
    for key in sorted(chosen):
        lines += strategy_markdown(key, chosen[key], rows)
        lines += explain_markdown(key, chosen[key], models[key])
    lines += memory_markdown(chosen)
    lines += stragglers.ranks_markdown(rows)  # per-rank tables of runs held back by one rank
    if pngs:
        lines += ["## Plots", ""]
        for name in pngs:
            lines += [f"![{plots.PLOTS[name]}]({name})", ""]
    notes = []
    for r in rows:
        notes += [f"- {r['run']}: {note}" for note in r["notes"]]
        notes += [f"- {r['run']}: unparseable [METRIC] line at train.log:{number}: {why}: "
                  f"`{text[:160]}`" for number, why, text in r["bad"][:5]]
        if len(r["bad"]) > 5:
            notes.append(f"- {r['run']}: ... and {len(r['bad']) - 5} more unparseable lines")
    if notes:
        lines += ["## Notes", ""] + notes + [""]
    # surrogateescape: a run folder's name that is not UTF-8 is written as its own bytes
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogateescape")


# --------------------------------------------------------------------------------------------
# Plots: what to draw, as plain numbers (plots.py draws it)
# --------------------------------------------------------------------------------------------

PLOTTED = ("epoch_time_s", "val_loss", "val_acc", "gpu0_peak_mib", "peak_mem_mib",
           "throughput_img_s")


def steps_per_epoch(row: dict):
    """The optimizer steps of the row's epoch (its training images over its global batch), or
    None where the log has neither: what makes a final epoch's validation figures comparable."""
    images, batch = num(row, "train_images"), num(row, "global_batch")
    return round(images / batch) if images and batch else None


def plot_data(chosen: dict) -> tuple:
    """(series, ideal, bars) for plots.study_plots: per strategy, a line through its 1-node runs
    and a dashed one per GPUs-per-node through its node sweep; the ideal throughput (1-GPU x
    GPUs) where there is a 1-GPU baseline; a bar of the step's parts per configuration."""
    def points(rows: list) -> list:  # a value that is no figure (nan, inf) is left out (None)
        return [dict(gpus=gpus(r), partial=r["status"] != OK, device=r.get("device"),
                     steps=steps_per_epoch(r),
                     **{column: throughput(r) if column == "throughput_img_s"
                        else contract.number(r.get(column)) for column in PLOTTED})
                for r in rows]

    series, ideal, bars = [], [], []
    for key in sorted(chosen):
        configs = {c: r for c, r in chosen[key].items()
                   if r["status"] in HAS_METRICS and num(r, "throughput_img_s") is not None}
        if not configs:
            continue
        name = key[1] + (f" ({key[2]})" if len({k[2] for k in chosen}) > 1 and key[2] else "")
        if any(n == 1 for n, g in configs):
            series.append(dict(group=key, strategy=key[1], label=f"{name}, 1 node", line="-",
                               points=points([configs[c] for c in sorted(configs) if c[0] == 1])))
        for g in sorted({g for n, g in configs if n > 1}):
            sweep = sorted(c for c in configs if c[1] == g)
            series.append(dict(group=key, strategy=key[1],
                               label=f"{name}, {g} GPU/node, 1-{sweep[-1][0]} nodes",
                               line="--", points=points([configs[c] for c in sweep])))
        base, own = chosen[key].get((1, 1)), sorted({gpus(r) for r in configs.values()})
        if base and base["baseline"] and len(own) > 1:
            ideal.append((key, f"{key[1]}, ideal (1-GPU x GPUs)", own,
                          [num(base, "throughput_img_s") * x for x in own]))
        for (n, g), r in sorted(chosen[key].items()):
            if num(r, "step_ms") is None:
                continue
            if num(r, "profile_step_ms") is not None:  # --profile traced the step's parts
                parts = dict(compute=num(r, "profile_compute_ms") or 0.0,
                             exposed_comm=num(r, "profile_exposed_comm_ms") or 0.0,
                             data_wait=num(r, "profile_data_wait_ms") or 0.0,
                             other=num(r, "profile_other_ms") or 0.0)
            else:  # only the epoch's data wait is known; the rest is left unexplained
                wait = num(r, "data_wait_ms") or 0.0
                parts = dict(data_wait=wait, unprofiled=max(0.0, num(r, "step_ms") - wait))
            unit = "process" if r.get("device") == "cpu" else "GPU"  # a CPU run has no GPUs
            bars.append((f"{key[1]}, {_count(n, 'node')} x {_count(g, unit)}", parts))
    return series, ideal, bars


def memory_bars(chosen: dict) -> list:
    """(label, {MEMORY_PARTS key: MiB}, measured peak or None) for memory_breakdown.png: the
    parts resident at the predicted peak (gradients only where they are), and the measured
    peak of a GPU run."""
    bars = []
    for label, r in memory_rows(chosen):
        parts = {k: num(r, f"predicted_{k}_mib") or 0.0 for k in MEMORY_PARTS}
        parts["grads"] = grads_in_peak(r)  # 0 if freed by then
        measured = num(r, "peak_mem_mib") if r.get("device") == "cuda" else None
        bars.append((label, parts, measured))
    return bars


def write_plots(chosen: dict, out_dir: Path, dpi: int) -> list:
    """The PNGs of plots.PLOTS in out_dir; returns their names (none when no run has metrics;
    memory_breakdown.png only where runs predicted their memory)."""
    series, ideal, bars = plot_data(chosen)
    if not series:
        print("note: no run with metrics to plot; no PNG written", file=sys.stderr)
        return []
    written = plots.study_plots(series, ideal, bars, out_dir, dpi)
    memory = memory_bars(chosen)
    if memory:
        found = memory_rows(chosen)
        written.append(plots.memory_plot(memory, memory_parts(found), out_dir, dpi,
                                         [label for label, r in found if grads_freed(r)]))
    return written
