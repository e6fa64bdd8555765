"""The output contract: the lines a training run prints for other programs, defined once.

Every line a launcher or a parser reacts to is ``[TAG] key=value ...``:

- ``[METRIC]``: one per epoch, with exactly ``METRIC_KEYS`` (the final one adds ``FINAL_KEYS``);
  collect_results.py makes results.csv from it, analyze_memory.py --plot marks the epochs;
- ``[STOP]``: a stop signal ended the run; launch/job.sh requeues the job when ``saved=1``;
- ``[EXIT]``: a torchrun worker's own exit code (torchrun reports any as 1), read by job.sh;
- ``[PROFILE]``: --profile's step breakdown (``PROFILE_KEYS``), read by collect_results.py;
- ``[BANDWIDTH]``: one collective's bandwidth and the network that carried it (``transport=``,
  training/network.py; absent from older logs) (--check, --profile), read by collect_results.py;
- ``[MEMORY]``: the predicted per-GPU memory by component (``MEMORY_KEYS``), at the start of
  every run and from --estimate-memory, read by collect_results.py;
- ``[RANKS]``: each rank's own time and waits in one epoch (``RANKS_KEYS``, values one per rank
  joined by ","), written by training/stragglers.py, read by collect_results.py.

loop.py and measure.py write the epoch and ``[METRIC]`` lines, stopping.py the ``[STOP]`` line,
faults.py the ``[EXIT]`` line, profiling.py the ``[PROFILE]`` line, bandwidth.py the
``[BANDWIDTH]`` lines; the parsers read them with ``fields`` (a value with ``number``). A
``[METRIC]`` line is read by one set of rules, ``read_metric_line``'s, whether a log's lines
(``metric_lines``) or one line of output (``parse_metric_line``). This module imports no
torch, so the parsers run on a login node without it.
"""

from __future__ import annotations

import math

METRIC_PREFIX, STOP_PREFIX, EXIT_PREFIX = "[METRIC]", "[STOP]", "[EXIT]"
PROFILE_PREFIX, BANDWIDTH_PREFIX = "[PROFILE]", "[BANDWIDTH]"
MEMORY_PREFIX = "[MEMORY]"
MEMORY_HELD_PREFIX = "[MEMORY-HELD]"  # --simulate-world-size: what rank 0 of N holds
RANKS_PREFIX = "[RANKS]"

#: Keys of every ``[METRIC]`` line, in order. The final line adds ``FINAL_KEYS``.
METRIC_KEYS = (
    "strategy", "model", "dataset", "device", "world_size", "nodes", "gpus_per_node",
    "per_gpu_batch", "global_batch", "amp", "image_size", "epoch", "epochs", "lr", "lr_peak",
    "lr_scaling", "warmup_epochs",
    "train_loss", "train_acc", "val_loss", "val_acc", "train_images", "val_images",
    "epoch_time_s", "throughput_img_s", "peak_mem_mib", "peak_mem_per_gpu_mib",
    "data_wait_frac", "train_start_unix", "eval_start_unix", "eval_end_unix",
    "slowest_rank", "rank_spread",
)

#: The [METRIC] keys whose values are text; every other value is a number ("nan" included),
#: but peak_mem_per_gpu_mib, one number per GPU joined by "/".
METRIC_TEXT_KEYS = ("strategy", "model", "dataset", "device", "amp", "lr_scaling",
                    "peak_mem_per_gpu_mib")

#: [METRIC] keys added after the first release: an older log's line without them still parses.
LATER_METRIC_KEYS = ("image_size", "slowest_rank", "rank_spread")

#: Extra keys of the one ``[METRIC]`` line printed after the last epoch (``final=1``).
FINAL_KEYS = ("final", "total_time_s")

#: The [METRIC] keys whose values must be numbers ("nan" is one): all but METRIC_TEXT_KEYS.
METRIC_NUMBER_KEYS = frozenset(METRIC_KEYS + FINAL_KEYS) - frozenset(METRIC_TEXT_KEYS)

#: --profile's parts of one training step, in milliseconds (``steps``: how many were traced),
#: and the host's launches per step (kernels, copies, graphs: what a CUDA graph saves).
PROFILE_KEYS = ("steps", "step_ms", "compute_ms", "exposed_comm_ms", "data_wait_ms", "other_ms",
                "comm_ms", "launches_per_step")

#: The keys every ``[MEMORY]`` line has, in order (sizes in MiB, per GPU, one process): the
#: model states, the activations saved for backward, what the strategy's communication holds,
#: the measured workspace of the GPU's libraries, the data held on the device and the input
#: batches in flight, and their sum, the predicted peak (training/memory.py says what each
#: counts).
MEMORY_SIZE_KEYS = ("params_mib", "grads_mib", "optimizer_mib", "buffers_mib", "amp_copies_mib",
                    "activations_mib", "comm_mib", "workspace_mib", "data_mib", "inputs_mib",
                    "host_mib", "peak_mib")

#: [MEMORY] keys added after the first release: an older log's line without them still parses
#: (its peak did not count them).
LATER_MEMORY_KEYS = ("data_mib", "inputs_mib", "workspace_mib")
#: Keys of older [MEMORY] lines only, read where a line has them: the backward transient
#: (twice the largest activation), which the workspace replaced (2026-11-28).
EARLIER_MEMORY_KEYS = ("transient_mib",)
MEMORY_KEYS = ("strategy", "variant", "world_size", "per_gpu_batch", "image_size",
               "amp") + MEMORY_SIZE_KEYS
#: Every size a [MEMORY] line of any version may have, in the order of collect_results.py's
#: columns: the older lines' transient beside the workspace that replaced it.
READ_MEMORY_SIZE_KEYS = ("params_mib", "grads_mib", "optimizer_mib", "buffers_mib",
                         "amp_copies_mib", "activations_mib", "comm_mib", "workspace_mib",
                         "transient_mib", "data_mib", "inputs_mib", "host_mib", "peak_mib")

#: --simulate-world-size's ``[MEMORY-HELD]`` line: what rank 0 of N holds, counted from its live
#: tensors (MiB; host_mib: --offload's share in host memory; units_in_flight: the most FSDP
#: units gathered at once, "-" for DDP; peak_mib: torch.cuda.max_memory_allocated, "-" on CPU).
MEMORY_HELD_KEYS = ("world_size", "params_mib", "grads_mib", "optimizer_mib", "host_mib",
                    "units_in_flight", "peak_mib")

#: The training scripts' --batch-size default (per GPU); launch/run_benchmarks.py plans with it.
DEFAULT_BATCH_SIZE = 64

#: Exit code after a checkpoint taken on SIGUSR1/SIGTERM: "requeue me, I will resume".
REQUEUE_EXIT = 75

#: Exit code when the loss became NaN/inf (nothing was saved over the last good checkpoint).
NONFINITE_EXIT = 3

#: The line rank 0 prints when a stop signal ended the run; launch/job.sh requeues the job
#: when it reads one with saved=1 (torchrun reports its workers' exit 75 as 1).
STOP_LINE = (STOP_PREFIX + " signal={signal} epoch={epoch} step={step} saved={saved} "
             "exit_code={code}")

#: The line a torchrun worker prints when it ends with a code of its own (2: a problem to fix,
#: NONFINITE_EXIT): launch/job.sh makes it the job's exit code (torchrun reports any as 1).
EXIT_LINE = EXIT_PREFIX + " code={code} rank={rank}"

#: The per-epoch line people read (the workshop's), values global across ranks.
EPOCH_LINE = ("Epoch [{epoch}/{epochs}] LR: {lr_shown} | Loss (train, val): {train_loss:.3f}, "
              "{val_loss:.3f} | Accuracy (train, val): {train_acc:.2f}%, {val_acc:.2f}% | "
              "Throughput: {throughput_img_s:.1f} img/s | Data wait: {data_wait_frac:.0%} | "
              "Images: {image_size}x{image_size}")


def format_epoch_line(m: dict) -> str:
    """The per-epoch line users know from the workshop (values global across ranks). The
    learning rate as the workshop shows it, 0.010000, where six decimals show it: 1e-07 or a
    warm-up's first epochs read "0.000000" so."""
    lr = m["lr"]
    return EPOCH_LINE.format(**m, lr_shown=f"{lr:.6f}" if 1e-4 <= lr < 1e6 else f"{lr:.3e}")


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):  # a clock time (1.8e9 s) keeps its tenths of a second
        return "nan" if math.isnan(value) else format(value, ".1f" if abs(value) >= 1e7 else ".7g")
    if isinstance(value, (list, tuple)):  # per-GPU values: "812.5/640.1"
        return "/".join(_fmt(v) for v in value)
    text = str(value)
    return text.replace(" ", "_") or "-"


def format_metric_line(m: dict, final: bool = False) -> str:
    """``[METRIC] key=value ...`` with exactly METRIC_KEYS (+ FINAL_KEYS on the last line)."""
    keys = METRIC_KEYS + (FINAL_KEYS if final else ())
    missing = [k for k in keys if k not in m and k != "final"]
    if missing:
        raise KeyError(f"metric line lacks {missing}")
    values = dict(m, final=1)
    return METRIC_PREFIX + " " + " ".join(f"{k}={_fmt(values[k])}" for k in keys)


def fields(line: str, tag: str) -> tuple | None:
    """``({key: value text}, stray)`` of the ``key=value`` tokens after ``tag`` in ``line``;
    ``stray``: the tokens without "=" (another process's output glued into the line). None when
    the line has no ``tag``. Anything before the tag (a "rank0:" prefix) is ignored."""
    at = line.find(tag)
    if at < 0:
        return None
    found, stray = {}, []
    for token in line[at + len(tag):].split():
        key, sep, value = token.partition("=")
        if sep:
            found[key] = value
        else:
            stray.append(token)
    return found, stray


def number(text) -> float | None:
    """A value's text as a finite float; None for "", "[N/A]", "nan", "inf", a missing value
    (None) or anything else that is not a finite number: a clock time of a [METRIC] line, or an
    optional column of an nvidia-smi log (analyze_memory.py), that may be unreadable."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def is_number(text: str) -> bool:
    """Whether text reads as a float ("nan" and "inf" do; number() says whether it is finite)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_metric_line(line: str) -> tuple | None:
    """A ``[METRIC]`` line read by the contract's rules: None when the line has no ``[METRIC]``
    tag, else ``(values, problem)``. values is {key: text as logged}; problem is None for a
    readable line, else a sentence saying why it is not one: text without "=" in it (another
    process's output glued into the line), no key=value at all, or a value of a
    METRIC_NUMBER_KEYS key that is not a number (a cut or garbled line)."""
    parsed = fields(line, METRIC_PREFIX)
    if parsed is None:
        return None
    values, stray = parsed
    if stray:
        return values, f"text without '=' in it ({stray[0][:40]!r}: another process's output?)"
    if not values:
        return values, "no key=value after the tag"
    not_numbers = [f"{k}={v}" for k, v in values.items()
                   if k in METRIC_NUMBER_KEYS and not is_number(v)]
    if not_numbers:
        return values, f"{not_numbers[0][:40]!r} is not a number (a cut or garbled line?)"
    return values, None


def metric_lines(lines):
    """The ``[METRIC]`` lines of a log given as its lines with their newlines (an open file):
    ``(line number, line, values, problem)`` for each, as read_metric_line says, where a last
    line without its newline is a problem too (the job was killed while writing it), and so is
    a line without a METRIC_KEYS key the readable line before it had: cut short, its last
    value perhaps too ("throughput_img_s=7" for 771.1), then a newline from the next writer.
    The keys are read generically (a log of an older script has fewer); a run resumed by a
    newer script only adds keys."""
    before = set()  # the METRIC_KEYS of the last readable line
    for lineno, line in enumerate(lines, 1):
        read = read_metric_line(line)
        if read is None:
            continue
        values, problem = read
        if not line.endswith("\n"):
            problem = "last line without its newline (the job was killed mid-write)"
        elif problem is None and (missing := [k for k in METRIC_KEYS
                                               if k in before and k not in values]):
            problem = (f"no {missing[0]}=, which the line before had, nor what follows it "
                       "(a line cut short?)")
        if problem is None:
            before = set(values)
        yield lineno, line, values, problem


def parse_metric_line(line: str) -> dict | None:
    """One complete ``[METRIC]`` line as {key: text}: readable by read_metric_line's rules and
    with every METRIC_KEYS key (but LATER_METRIC_KEYS); None when the line is not one."""
    read = read_metric_line(line)
    required = [k for k in METRIC_KEYS if k not in LATER_METRIC_KEYS]
    if read is None or read[1] is not None or not all(k in read[0] for k in required):
        return None
    return read[0]


#: A rank whose own time is more than this over the median rank's is named a straggler (the
#: training's straggler line, results.md's per-rank tables, the timeline's mark).
SLOW_RANK_SPREAD = 1.10

#: The ``[RANKS]`` line: per epoch, each rank's seconds of own time (compute + data wait),
#: compute, data wait (its loader) and rank wait (for the other ranks, in collectives), its
#: node and device; every value holds one entry per rank (DataParallel: per device), in rank
#: order, joined by ",".
RANKS_KEYS = ("epoch", "own_s", "compute_s", "data_wait_s", "rank_wait_s", "node", "device")
RANKS_NUMBER_KEYS = ("own_s", "compute_s", "data_wait_s", "rank_wait_s")

#: [RANKS] keys renamed since a log was written (old name: new name): an older log's line
#: still parses into the new names. "wait_s" was the rank wait, and the loader's wait too in
#: the code, so each got a name of its own.
RENAMED_RANKS_KEYS = {"data_s": "data_wait_s", "wait_s": "rank_wait_s"}


def format_ranks_line(epoch: int, ranks: list) -> str:
    """``[RANKS] epoch=E own_s=a,b ...`` from one dict per rank (RANKS_KEYS but epoch)."""
    def joined(key):
        return ",".join(f"{r[key]:.3f}" if key in RANKS_NUMBER_KEYS else _fmt(r[key]).replace(
            ",", "_") for r in ranks)
    return RANKS_PREFIX + f" epoch={epoch} " + " ".join(f"{k}={joined(k)}"
                                                        for k in RANKS_KEYS[1:])


def parse_ranks_line(line: str) -> tuple | None:
    """(epoch, [one dict per rank]) of a complete ``[RANKS]`` line (numbers as floats), an
    older log's line under today's key names (RENAMED_RANKS_KEYS); None when the line is not
    one, or is cut or garbled (values of unequal counts, not numbers)."""
    parsed = fields(line, RANKS_PREFIX)
    if parsed is None or parsed[1]:
        return None
    found = {RENAMED_RANKS_KEYS.get(k, k): v for k, v in parsed[0].items()}
    if not all(k in found for k in RANKS_KEYS):
        return None
    values = {k: found[k].split(",") for k in RANKS_KEYS[1:]}
    if len({len(v) for v in values.values()}) != 1:
        return None
    ranks = []
    for i in range(len(values["own_s"])):
        rank = {k: v[i] for k, v in values.items()}
        for k in RANKS_NUMBER_KEYS:
            rank[k] = number(rank[k])
            if rank[k] is None:
                return None
        ranks.append(rank)
    return found["epoch"], ranks
