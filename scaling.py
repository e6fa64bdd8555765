"""The numbers of a scaling study: run statuses, scaling factors, and a model beyond the study.

collect_results.py reads the run directories into rows (plain dicts, one per run, the columns of
results.csv); this module marks which row of each configuration the tables use and adds the
columns that compare runs: throughput and memory scaling against the 1-GPU run, the step time and
its data wait, and the scaling model's prediction (the formula is in the README, "A scaling
model"). report.py turns the rows into results.md and the plots. No torch, no project imports.
"""

from __future__ import annotations

STRATEGIES = ("dp", "ddp", "fsdp")  # in table order; launch/run_benchmarks.py's --strategies

# The status of a run (collect_results.py's docstring says what each means).
OK, REQUEUED, PARTIAL, FAILED, UNREADABLE, MISSING, SKIPPED = (
    "ok", "requeued", "partial", "failed", "unreadable", "missing", "skipped")
STATUSES = (OK, REQUEUED, PARTIAL, FAILED, UNREADABLE, MISSING, SKIPPED)  # best first
HAS_METRICS = (OK, REQUEUED, PARTIAL)  # statuses whose numbers go into the tables


# --------------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------------

def num(row: dict, key: str) -> float | None:
    """A row's value as a number; None when it is empty or not a number. nan and inf stay what
    they are (a diverged loss shows as nan in the tables), unlike contract.number."""
    try:
        return float(row.get(key))
    except (TypeError, ValueError):
        return None


def gpus(row: dict) -> int | None:
    """The row's GPUs (processes on CPU): nodes x GPUs per node; None when either is unknown."""
    nodes, per_node = num(row, "nodes"), num(row, "gpus_per_node")
    return None if nodes is None or per_node is None else int(nodes * per_node)


def group_of(row: dict) -> tuple:
    """The tables are per strategy (in STRATEGIES order) and scaling mode."""
    s = row.get("strategy") or ""
    return (STRATEGIES.index(s) if s in STRATEGIES else len(STRATEGIES), s, row["scaling"])


def best(rows: list) -> dict:
    """The row the tables use among the runs of one configuration: the best status, then the
    newest run."""
    newest_first = sorted(rows, key=lambda r: r["start_time"], reverse=True)
    return min(newest_first, key=lambda r: STATUSES.index(r["status"]))


def _4(x: float) -> str:
    return f"{x:.4f}".rstrip("0").rstrip(".")


def scale(rows: list) -> dict:
    """Mark each configuration's best row used_in_tables and give every row with numbers its
    scaling factors against the 1-GPU, 1-node row of its group. Returns {group: {(nodes,
    GPUs per node): the row in the tables}}."""
    groups = {}
    for row in rows:
        if gpus(row) is None:
            row["notes"].append("configuration unknown (no [METRIC] line, job.env or plan); "
                                "not in the tables")
            continue
        config = (int(num(row, "nodes")), int(num(row, "gpus_per_node")))
        groups.setdefault(group_of(row), {}).setdefault(config, []).append(row)
    chosen = {}
    for key, configs in groups.items():
        chosen[key] = {config: best(runs) for config, runs in configs.items()}
        base = chosen[key].get((1, 1))
        if base and (base["status"] not in HAS_METRICS or not num(base, "throughput_img_s")):
            base = None
        for config, runs in configs.items():
            used = chosen[key][config]
            for row in runs:
                row["used_in_tables"] = int(row is used)
                if row is not used:
                    row["notes"].append(f"superseded in the tables by {used['run']} "
                                        f"({used['status']})")
                if base and row["status"] in HAS_METRICS and gpus(row) and num(
                        row, "throughput_img_s") is not None:
                    speedup = num(row, "throughput_img_s") / num(base, "throughput_img_s")
                    row.update(baseline=base["run"], throughput_scaling=_4(speedup),
                               parallel_efficiency=_4(speedup / gpus(row)))
                    if num(row, "gpu0_avg_mib") is not None and num(base, "gpu0_avg_mib"):
                        row["memory_avg_scaling"] = _4(num(row, "gpu0_avg_mib")
                                                       / num(base, "gpu0_avg_mib"))
    return chosen


# --------------------------------------------------------------------------------------------
# Why not N x: the parts of a step, and a scaling model beyond the study
# --------------------------------------------------------------------------------------------

#: The share of the 1-GPU step that a strategy's communication can hide behind: DDP
#: all-reduces gradient buckets during backward (about 2/3 of forward + backward); FSDP
#: prefetches the next all-gather during forward and backward alike.
OVERLAP = {"ddp": 2 / 3, "fsdp": 1.0}
COLLECTIVES = {"ddp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter")}
MODEL_NODES = (2, 4, 8, 16, 32, 64)


def step_times(rows: list) -> None:
    """step_ms (training time of one step in the row's epoch) and data_wait_ms, its share
    spent waiting for the loader, for every row with numbers."""
    for row in rows:
        t, n, b = num(row, "epoch_time_s"), num(row, "train_images"), num(row, "global_batch")
        if row["status"] in HAS_METRICS and t and n and b:
            step = t * 1e3 * b / n
            row["step_ms"] = _4(step)
            if num(row, "data_wait_frac") is not None:
                row["data_wait_ms"] = _4(num(row, "data_wait_frac") * step)


def comm_ms(strategy: str, n: int, grad_bytes: float, busbw: dict) -> float:
    """Milliseconds of communication per step at ``n`` ranks with ring collectives, from the
    bus bandwidth per collective (GB/s, as nccl-tests define it: time = bytes x factor / busbw,
    factor 2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter)."""
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    if strategy == "ddp":  # one all-reduce of the gradients
        return 2 * ring * grad_bytes / busbw["all_reduce"] / 1e6
    # fsdp: the parameters all-gathered for forward and again for backward, the gradients
    # reduce-scattered
    return (2 * ring * grad_bytes / busbw["all_gather"]
            + ring * grad_bytes / busbw["reduce_scatter"]) / 1e6


def predict_step_ms(strategy: str, t1_ms: float, n: int, grad_bytes: float,
                    busbw: dict) -> float:
    """Weak scaling: every GPU does the 1-GPU run's work (t1_ms a step) and waits for the
    communication that compute does not hide: step(n) = t1 + max(0, comm(n) - h x t1), h =
    OVERLAP[strategy]. Parallel efficiency = t1 / step(n)."""
    return t1_ms + max(0.0, comm_ms(strategy, n, grad_bytes, busbw) - OVERLAP[strategy] * t1_ms)


def model_inputs(key: tuple, configs: dict) -> tuple:
    """(inputs of the scaling model for a table group, or None, and why not). t1: the 1-GPU
    run's step; gradient bytes and bus bandwidth: the run with the most nodes that measured
    them (--profile or --check)."""
    _order, strategy, scaling = key
    if strategy not in OVERLAP:
        return None, f"no scaling model for {strategy or 'this strategy'} (one process)"
    if scaling == "strong":
        return None, "the scaling model covers weak scaling (fixed work per GPU)"
    base = configs.get((1, 1))
    if not base or num(base, "step_ms") is None:
        return None, "no scaling model: it needs the 1-GPU run's step time"
    ops = COLLECTIVES[strategy]
    measured = [r for r in configs.values() if num(r, "grad_bytes")
                and all(num(r, f"busbw_{op}_gbs") for op in ops)]
    if not measured:
        return None, ("no scaling model: no run measured its bus bandwidth; run the study with "
                      "`-- --profile` (each multi-GPU run then measures it)")
    source = max(measured, key=lambda r: (num(r, "nodes"), gpus(r)))
    nodes = int(num(source, "nodes"))
    per_node = int(num(source, "gpus_per_node")) if nodes > 1 else max(
        g for n, g in configs if n == 1)
    return dict(strategy=strategy, t1=num(base, "step_ms"), grad_bytes=num(source, "grad_bytes"),
                busbw={op: num(source, f"busbw_{op}_gbs") for op in ops}, source=source,
                per_node=per_node), ""


def predict(rows: list, chosen: dict) -> None:
    """Each measured multi-GPU row of a group with a scaling model: its predicted step and
    the relative error of the prediction. Call step_times first: the model starts from them."""
    for key, configs in chosen.items():
        inputs, _why = model_inputs(key, configs)
        for row in configs.values() if inputs else ():
            if gpus(row) > 1 and num(row, "step_ms"):
                predicted = predict_step_ms(inputs["strategy"], inputs["t1"], gpus(row),
                                            inputs["grad_bytes"], inputs["busbw"])
                row["predicted_step_ms"] = _4(predicted)
                row["prediction_error"] = _4(predicted / num(row, "step_ms") - 1)


def beyond_study(inputs: dict, configs: dict) -> list:
    """The scaling model's table for a group with model_inputs' inputs: (nodes, GPUs per node,
    predicted step ms, the measured row or None) for MODEL_NODES nodes of the measuring run's
    GPUs per node, and for every measured row that predict() gave a prediction, in order."""
    measured = {c: r for c, r in configs.items() if r["predicted_step_ms"]}
    planned = {(n, inputs["per_node"]): None for n in MODEL_NODES}
    table = []
    for (nodes, g), row in sorted({**planned, **measured}.items()):
        step = num(row, "predicted_step_ms") if row else predict_step_ms(
            inputs["strategy"], inputs["t1"], nodes * g, inputs["grad_bytes"], inputs["busbw"])
        table.append((nodes, g, step, row))
    return table
