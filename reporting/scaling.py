"""The numbers of a scaling study: run statuses, scaling factors, and a model beyond the study.

collect_results.py reads the run directories into rows (plain dicts, one per run, the columns of
results.csv); this module marks which row of each configuration the tables use and adds the
columns that compare runs: throughput and memory scaling against the 1-GPU run, the step time and
its data wait, and the scaling model's prediction (the formula is in docs/slurm.md, "A scaling
model"). report.py turns the rows into results.md and the plots. No torch, no project imports.
"""

from __future__ import annotations

import math

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


def throughput(row: dict) -> float | None:
    """The row's throughput as a figure to show and to scale by: a finite number above 0. None
    when none was logged, or for a nan, inf, 0 or negative one (an epoch timed at 0 s logs 0),
    which scale() notes on the row."""
    value = num(row, "throughput_img_s")
    return value if value is not None and math.isfinite(value) and value > 0 else None


def gpus(row: dict) -> int | None:
    """The row's GPUs (processes on CPU): nodes x GPUs per node; None when either is unknown."""
    nodes, per_node = num(row, "nodes"), num(row, "gpus_per_node")
    return None if nodes is None or per_node is None else int(nodes * per_node)


def group_of(row: dict) -> tuple:
    """The tables are per strategy (in STRATEGIES order) and scaling mode."""
    s = row.get("strategy") or ""
    return (STRATEGIES.index(s) if s in STRATEGIES else len(STRATEGIES), s, row["scaling"])


def newness(row: dict) -> tuple:
    """How new a run is: its start time (job.env), then its Slurm job id (job.env's, else the
    end of its run directory's name, <job name>-<job id>): without job.env the start times are
    all empty, and the later job is the newer."""
    job = row.get("job_id") or row["run"].rsplit("-", 1)[-1]
    return row["start_time"], int(job) if job.isdigit() else -1


def best(rows: list) -> dict:
    """The row the tables use among the runs of one configuration: the best status, then the
    newest run."""
    newest_first = sorted(rows, key=newness, reverse=True)
    return min(newest_first, key=lambda r: STATUSES.index(r["status"]))


def four_decimals(x: float) -> str:
    """x as results.csv writes a ratio or a time: at most four decimals, no trailing zeros."""
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
        if base and (base["status"] not in HAS_METRICS or throughput(base) is None):
            base = None
        for config, runs in configs.items():
            used = chosen[key][config]
            for row in runs:
                row["used_in_tables"] = int(row is used)
                if row is not used:
                    row["notes"].append(f"superseded in the tables by {used['run']} "
                                        f"({used['status']})")
                logged = row["status"] in HAS_METRICS and num(row, "throughput_img_s") is not None
                if logged and throughput(row) is None:  # the tables show "—" instead
                    why = (f"throughput_img_s={row['throughput_img_s']} is not a finite number "
                           f"above 0: no throughput or scaling figure")
                    if config == (1, 1) and row is used:
                        why += "; not used as the 1-GPU baseline, so the runs beside it have none"
                    row["notes"].append(why)
                if base and logged and gpus(row):
                    row["baseline"] = base["run"]
                    if throughput(row) is not None:
                        speedup = throughput(row) / throughput(base)
                        row.update(throughput_scaling=four_decimals(speedup),
                                   parallel_efficiency=four_decimals(speedup / gpus(row)))
                    if num(row, "gpu0_avg_mib") is not None and num(base, "gpu0_avg_mib"):
                        row["memory_avg_scaling"] = four_decimals(
                            num(row, "gpu0_avg_mib") / num(base, "gpu0_avg_mib"))
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

#: What the model assumes where a study did not measure it (collect_results.py's flags set both):
#: the bus bandwidth between nodes when no multi-node run measured one, in GB/s (12 GB/s: one
#: 100 Gb/s InfiniBand EDR or Ethernet link per node, as nccl-tests' busbw reaches it), and the
#: latency of one step of a ring, in microseconds (a message between two nodes through NCCL's
#: network proxy; an all-reduce of N ranks takes 2(N-1) such steps, an all-gather N-1).
INTER_NODE_BUSBW_GBS = 12.0
RING_STEP_LATENCY_US = 10.0
#: Messages per step where a run did not say (a [BANDWIDTH] line without messages=): DDP's
#: gradients in buckets of its default 25 MiB.
DDP_BUCKET_BYTES = 25 * 2**20


def step_times(rows: list) -> None:
    """step_ms (training time of one step in the row's epoch) and data_wait_ms, its share
    spent waiting for the loader, for every row with numbers."""
    for row in rows:
        t, n, b = num(row, "epoch_time_s"), num(row, "train_images"), num(row, "global_batch")
        if row["status"] in HAS_METRICS and t and n and b:
            step = t * 1e3 * b / n
            row["step_ms"] = four_decimals(step)
            if num(row, "data_wait_frac") is not None:
                row["data_wait_ms"] = four_decimals(num(row, "data_wait_frac") * step)


def comm_ms(strategy: str, n: int, grad_bytes: float, busbw: dict, messages: dict,
            latency_us: float) -> float:
    """Milliseconds of communication per step at ``n`` ranks with ring collectives: the bytes
    over the bus bandwidth (GB/s, as nccl-tests define it: time = bytes x factor / busbw,
    factor 2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter) plus each
    message's ring steps x ``latency_us`` (2(n-1) for an all-reduce, n-1 for the others).
    ``messages``: collectives per step, per kind."""
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    latency = latency_us / 1e3
    if strategy == "ddp":  # DDP all-reduces the gradients, bucket by bucket
        return (2 * ring * grad_bytes / busbw["all_reduce"] / 1e6
                + messages["all_reduce"] * 2 * (n - 1) * latency)
    # FSDP all-gathers the parameters for forward and, when it reshards them after forward
    # (full), again for backward; it reduce-scatters the gradients. grad-op keeps the gathered
    # parameters until backward, so it has one gather per scatter.
    gathers = messages["all_gather"] / messages["reduce_scatter"]
    return (gathers * ring * grad_bytes / busbw["all_gather"] / 1e6
            + ring * grad_bytes / busbw["reduce_scatter"] / 1e6
            + (messages["all_gather"] + messages["reduce_scatter"]) * (n - 1) * latency)


def exposed_ms(inputs: dict, nodes: int, per_node: int) -> float:
    """The communication of a step on ``nodes`` x ``per_node`` ranks that compute does not
    hide: max(0, comm - h x t1), h = inputs["hidden"]. Between nodes the ring runs at the
    slower of the two bandwidths: the one within a node and the one between nodes."""
    bw = inputs["busbw_node"] if nodes == 1 else {
        op: min(v, inputs["busbw_inter"][op]) for op, v in inputs["busbw_node"].items()}
    comm = comm_ms(inputs["strategy"], nodes * per_node, inputs["grad_bytes"], bw,
                   inputs["messages"], inputs["latency_us"])
    return max(0.0, comm - inputs["hidden"] * inputs["t1"])


def predict_step_ms(inputs: dict, nodes: int, per_node: int) -> float:
    """Weak scaling: every GPU does the 1-GPU run's work (t1 ms a step), waits for the
    communication compute does not hide, and pays the overhead the model does not explain,
    as measured at the largest run of the study (stragglers, synchronisation, the loader):
    step = t1 + exposed + carried. Parallel efficiency = t1 / step. (model_inputs fits
    ``carried`` and ``hidden`` so that the largest run is predicted as measured.)"""
    return inputs["t1"] + exposed_ms(inputs, nodes, per_node) + inputs["carried"]


def _measured(configs: dict, ops: tuple, multi_node: bool) -> dict | None:
    """The run with the most ranks, within a node or across nodes, that measured the bus
    bandwidth of every collective in ``ops`` (--profile or --check)."""
    runs = [r for r in configs.values() if num(r, "grad_bytes") and (num(r, "nodes") > 1) ==
            multi_node and all(num(r, f"busbw_{op}_gbs") for op in ops)]
    return max(runs, key=lambda r: (gpus(r), num(r, "nodes"))) if runs else None


def model_inputs(key: tuple, configs: dict, inter_busbw: float = INTER_NODE_BUSBW_GBS,
                 latency_us: float = RING_STEP_LATENCY_US) -> tuple:
    """(inputs of the scaling model for a table group, or None, and why not). t1: the 1-GPU
    run's step; bus bandwidth within a node and between nodes: the largest run of each kind
    that measured it (--profile or --check), else the other kind's figure within a node and
    ``inter_busbw`` between nodes; the overhead to carry: the largest measured run's step
    minus what the model explains of it."""
    _order, strategy, scaling = key
    if strategy not in OVERLAP:
        return None, f"no scaling model for {strategy or 'this strategy'} (one process)"
    if scaling == "strong":
        return None, "the scaling model covers weak scaling (fixed work per GPU)"
    base = configs.get((1, 1))
    if not base or num(base, "step_ms") is None:
        return None, "no scaling model: it needs the 1-GPU run's step time"
    ops = COLLECTIVES[strategy]
    node, inter = _measured(configs, ops, False), _measured(configs, ops, True)
    if not node and not inter:
        return None, ("no scaling model: no run measured its bus bandwidth; run the study with "
                      "`-- --profile` (each multi-GPU run then measures it)")
    source = inter or node
    grad_bytes = num(source, "grad_bytes")
    if all(num(source, f"messages_{op}") for op in ops):
        messages = {op: num(source, f"messages_{op}") for op in ops}
        counted = True
    else:  # an older log has no counts: assume DDP's default buckets, one FSDP unit per bucket
        buckets = -(-grad_bytes // DDP_BUCKET_BYTES)
        messages = {"all_reduce": buckets} if strategy == "ddp" else {
            "all_gather": 2 * buckets, "reduce_scatter": buckets}
        counted = False
    busbw_node = {op: num(node or inter, f"busbw_{op}_gbs") for op in ops}
    busbw_inter = ({op: num(inter, f"busbw_{op}_gbs") for op in ops} if inter
                   else {op: inter_busbw for op in ops})
    per_node = int(num(inter, "gpus_per_node")) if inter else max(g for n, g in configs
                                                                  if n == 1)
    inputs = dict(strategy=strategy, t1=num(base, "step_ms"), grad_bytes=grad_bytes,
                  busbw_node=busbw_node, busbw_inter=busbw_inter, node_source=node,
                  inter_source=inter, messages=messages, messages_counted=counted,
                  latency_us=latency_us, per_node=per_node, hidden=OVERLAP[strategy],
                  carried=0.0, anchor=None)
    runs = [r for r in configs.values() if gpus(r) and gpus(r) > 1 and num(r, "step_ms")]
    if runs:
        fit_to_largest_run(inputs, max(runs, key=lambda r: (gpus(r), num(r, "nodes"))))
    return inputs, ""


def fit_to_largest_run(inputs: dict, anchor: dict) -> None:
    """Make the model agree with the study's largest run. Slower than the model says: the
    difference (stragglers, synchronisation, the loader) is carried to every other size as a
    constant per step. Faster: compute hid more of the communication than h says, so h
    becomes what that run hid (and, were it faster than t1 itself, the rest is carried)."""
    inputs["anchor"] = anchor
    nodes, per_node = int(num(anchor, "nodes")), int(num(anchor, "gpus_per_node"))
    measured, t1 = num(anchor, "step_ms"), inputs["t1"]
    excess = measured - predict_step_ms(inputs, nodes, per_node)
    if excess >= 0:
        inputs["carried"] = excess
        return
    comm = exposed_ms(dict(inputs, hidden=0.0), nodes, per_node)
    inputs["hidden"] = (comm - max(0.0, measured - t1)) / t1
    inputs["carried"] = min(0.0, measured - t1)


def predict(rows: list, chosen: dict, inter_busbw: float = INTER_NODE_BUSBW_GBS,
            latency_us: float = RING_STEP_LATENCY_US) -> dict:
    """Each measured multi-GPU row of a group with a scaling model: its predicted step and
    the relative error of the prediction (zero at the largest run, whose overhead the model
    carries). Call step_times first: the model starts from them. Returns {group: (model
    inputs or None, why not)}."""
    models = {}
    for key, configs in chosen.items():
        inputs, why = models[key] = model_inputs(key, configs, inter_busbw, latency_us)
        for row in configs.values() if inputs else ():
            if gpus(row) > 1 and num(row, "step_ms"):
                predicted = predict_step_ms(inputs, int(num(row, "nodes")),
                                            int(num(row, "gpus_per_node")))
                row["predicted_step_ms"] = four_decimals(predicted)
                row["prediction_error"] = four_decimals(predicted / num(row, "step_ms") - 1)
    return models


def beyond_study(inputs: dict, configs: dict) -> list:
    """The scaling model's table for a group with model_inputs' inputs: (nodes, GPUs per node,
    predicted step ms, the measured row or None) for MODEL_NODES nodes of the measuring run's
    GPUs per node, and for every measured row that predict() gave a prediction, in order."""
    measured = {c: r for c, r in configs.items() if r["predicted_step_ms"]}
    planned = {(n, inputs["per_node"]): None for n in MODEL_NODES}
    table = []
    for (nodes, g), row in sorted({**planned, **measured}.items()):
        step = num(row, "predicted_step_ms") if row else predict_step_ms(inputs, nodes, g)
        table.append((nodes, g, step, row))
    return table
