"""The memory model against the GPU's measurements, on any machine: every training row that
bench/gpu_check.py measured (its JSON lines: the command, torch.cuda.max_memory_allocated's
peak, the prediction of its day), predicted again by the model as it is now (the row's command
with --estimate-memory 1, on this CPU), and the errors then and now.

    python bench/memory_check.py bench/results/gpu-h200-2026-11-27b.jsonl \\
        bench/results/gpu-h200-2026-11-28.jsonl
    python bench/memory_check.py --backward --batches 16,64,128,256

The last line of the first is what training/memory.py's WORKSPACE comes from: what the eager
rows allocated beside the counted parts (the median over their configurations). --backward
replays one training step on the CPU and follows every storage it makes: what the forward
leaves saved for backward, against the most that is alive at once during the backward, and
what the model's former "transient" (twice the largest saved activation) said that would be.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import statistics
import subprocess
import sys
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training import contract  # noqa: E402
from training.faults import UsageError  # noqa: E402
from training.memory import MIB, WORKSPACE  # noqa: E402

SCRIPTS = ("ddp_train.py", "fsdp_train.py", "dp_train.py")


class BadFile(Exception):
    """A file that is not gpu_check's JSON lines: its sentence."""


def read_rows(paths: list) -> list:
    """The training rows with a measured peak on a GPU, in file order, each with its
    ``command``: (script, flags) to predict it with."""
    rows = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise BadFile(f"cannot read {path} ({getattr(err, 'strerror', None) or err}): give "
                          f"the JSON lines file bench/gpu_check.py wrote beside its --out")
        for number, line in enumerate(lines, 1):
            where = f"{path}, line {number},"
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise BadFile(f"{where} is not a JSON line: give the file bench/gpu_check.py "
                              f"wrote beside its --out") from None
            if not isinstance(row, dict):
                raise BadFile(f"{where} is not a row of bench/gpu_check.py")
            if row.get("kind") == "train" and row.get("device") == "cuda" and row.get("peak"):
                rows.append(checked_row(row, where))
    return rows


def checked_row(row: dict, where: str) -> dict:
    """``row`` with its ``command`` and whether it ran eager, or BadFile naming what a
    training row lacks."""
    numbers = {"peak": row.get("peak"), "predicted": row.get("predicted", 0) or 0}
    missing = [key for key in ("label", "image", "batch", "cmd") if key not in row]
    if missing or not isinstance(row["cmd"], str) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers.values()):
        raise BadFile(f"{where} is not a training row of bench/gpu_check.py: it needs a label, "
                      f"image, batch, cmd (text) and a peak (a number)"
                      + (f"; missing: {', '.join(missing)}" if missing else ""))
    try:
        words = shlex.split(row["cmd"])
    except ValueError as err:
        raise BadFile(f"{where} has a command that does not split into words ({err})") from None
    at = next((i for i, w in enumerate(words) if Path(w).name in SCRIPTS), None)
    if at is None:
        raise BadFile(f"{where} has a command that runs none of {', '.join(SCRIPTS)}")
    flags = without_graphs(words[at + 1:])
    eager = flags == words[at + 1:]  # no CUDA graph, no torch.compile: the model's own memory
    if "--amp" not in flags:  # the GPU's default, which the row says
        if not isinstance(row.get("amp"), str):
            raise BadFile(f"{where} says neither --amp in its command nor an amp")
        flags += ["--amp", row["amp"]]
    return row | {"command": (Path(words[at]).name, tuple(flags)), "eager": eager}


def without_graphs(flags: list) -> list:
    """The flags without --cuda-graph and --compile [MODE]: they change how the step runs,
    not what the model predicts (and one estimate then serves the eager row and its graphs)."""
    kept, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
        elif flag == "--cuda-graph" or flag.startswith("--compile="):
            continue
        elif flag == "--compile":
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("-")
        else:
            kept.append(flag)
    return kept


def predict(script: str, flags: list) -> tuple:
    """(the [MEMORY] figures of the run's own variant at one GPU, or None; why not)."""
    try:
        proc = subprocess.run([sys.executable, str(REPO / script), *flags, "--estimate-memory",
                               "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, "the estimate took over 10 minutes"
    if proc.returncode:
        return None, (proc.stderr.strip().splitlines() or ["no message"])[-1]
    lines = [parsed[0] for line in proc.stdout.splitlines()
             if (parsed := contract.fields(line, contract.MEMORY_PREFIX + " "))]
    if not lines:
        return None, "the script printed no [MEMORY] line"
    module = importlib.import_module(script[:-3])
    variant = module.memory_variant(module.build_parser().parse_args(flags))
    for figures in lines:
        if figures.get("variant") == variant:
            return {k: float(v) for k, v in figures.items() if contract.is_number(v)}, ""
    return None, f"no [MEMORY] line for variant {variant}"


def within_5_percent(predicted: float, measured: float) -> bool:
    return abs(predicted / measured - 1) <= 0.05


def check(paths: list) -> int:
    try:
        rows = read_rows(paths)
        if not rows:
            raise BadFile(f"no training row measured on a GPU in {', '.join(paths)}: give the "
                          f"JSON lines of a bench/gpu_check.py run on a GPU")
    except BadFile as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    predicted, implied = {}, {}
    print("| row | image | batch | measured (MiB) | predicted then | error | predicted now "
          "| error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    within = {"then": 0, "now": 0, "predicted": 0}
    for row in rows:
        command, measured, then = row["command"], row["peak"], row.get("predicted")
        if command not in predicted:
            predicted[command] = predict(command[0], list(command[1]))
        figures, why = predicted[command]
        cells = [row["label"], row["image"], row["batch"], f"{measured:,.0f}"]
        if then:
            cells += [f"{then:,.0f}", f"{then / measured - 1:+.1%}"]
            within["then"] += within_5_percent(then, measured)
        else:
            cells += ["", ""]
        if figures is None:
            cells += [f"not predicted here: {why}", ""]
        else:
            now = figures["peak_mib"]
            cells += [f"{now:,.0f}", f"{now / measured - 1:+.1%}"]
            within["now"] += within_5_percent(now, measured)
            within["predicted"] += 1
            if row["eager"]:  # what the step held beside the parts the model counts
                implied[command] = measured - (now - figures.get("workspace_mib", 0))
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"\nwithin 5%: {within['then']} of {len(rows)} rows then; now {within['now']} of the "
          f"{within['predicted']} predicted here (workspace {WORKSPACE / MIB:.0f} MiB)")
    if implied:
        values = sorted(implied.values())
        print(f"beside the counted parts the eager rows' {len(values)} configurations held "
              f"{', '.join(f'{v:.0f}' for v in values)} MiB: median "
              f"{statistics.median(values):.0f}")
    return 0


def replay(model_name: str, image_size: int | None, batches: list, amp: str) -> int:
    """One training step on the CPU per batch, every storage it makes followed to its end."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from training import memory, models

    class Live(TorchDispatchMode):
        """The bytes of the storages the ops made that are still alive, and their most; and
        for each, whether it holds images of the batch (what the former transient took)."""

        def __init__(self, batch: int, own: set):
            super().__init__()
            self.batch, self.live, self.peak, self.sizes = batch, 0, 0, {}
            self.own = own  # the model's parameters, buffers and gradients: never counted

        def _gone(self, key: int) -> None:
            self.live -= self.sizes.pop(key)[0]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key not in self.sizes and key not in self.own:
                        images = t.dim() > 0 and t.shape[0] == self.batch
                        self.sizes[key] = (storage.nbytes(), images)
                        self.live += storage.nbytes()
                        weakref.finalize(storage, self._gone, key)
            self.peak = max(self.peak, self.live)
            return out

    shape, classes = models.synthetic_shape(model_name)
    if image_size is not None:
        shape = (shape[0], image_size, image_size)
    torch.manual_seed(0)
    model = models.build_model(model_name, classes, shape).train()
    saved = memory.saved_for_backward(model, shape, amp)
    print(f"{model_name}, {'x'.join(map(str, shape))} images, --amp {amp}: MiB on the CPU "
          f"(2 x largest: what the model's former backward transient added)")
    print(f"{'batch':>6}{'saved (model)':>15}{'saved (replay)':>16}{'backward peak':>15}"
          f"{'peak - saved':>14}{'2 x largest':>13}")
    for batch in batches:
        for p in model.parameters():  # the gradients exist already, as DDP's buckets do
            p.grad = torch.zeros_like(p)
        own = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad)}
        live = Live(batch, own | {b.untyped_storage().data_ptr() for b in model.buffers()})
        with live:
            # made inside, then let go: the replay keeps the images only where the model
            # saves them (its first layer, in fp32), as the count with hooks does
            images = torch.randn(batch, *shape)
            labels = torch.randint(0, classes, (batch,))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp != "off"):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            del images, labels
            after_forward = live.peak = live.live  # from here on, the backward's most
            largest = max((n for n, imgs in live.sizes.values() if imgs), default=0)
            loss.backward()
        del loss
        counted = saved.per_image * batch + saved.fixed
        print(f"{batch:>6}{counted / MIB:>15.1f}{after_forward / MIB:>16.1f}"
              f"{live.peak / MIB:>15.1f}{(live.peak - after_forward) / MIB:>14.1f}"
              f"{2 * largest / MIB:>13.1f}")
    return 0


REPLAY_FLAGS = {"model": "resnet50", "image_size": None, "batches": "16,64,128", "amp": "bf16"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", nargs="*", help="bench/gpu_check.py's JSON lines files")
    parser.add_argument("--backward", action="store_true",
                        help="replay training steps on the CPU instead (no files)")
    parser.add_argument("--model", help="--backward's model (default resnet50)")
    parser.add_argument("--image-size", type=int,
                        help="--backward's image side in pixels (default: the model's own)")
    parser.add_argument("--batches",
                        help="--backward's batch sizes, separated by commas (default 16,64,128)")
    parser.add_argument("--amp", choices=("bf16", "fp16", "off"),
                        help="--backward's precision (default bf16; fp16 counts as bf16: the "
                             "same two bytes)")
    args = parser.parse_args(argv)
    given = [f"--{k.replace('_', '-')}" for k in REPLAY_FLAGS if getattr(args, k) is not None]
    if not args.backward:
        if given:
            parser.error(f"{', '.join(given)}: for --backward only; add it, or give the JSON "
                         f"lines files alone")
        if not args.jsonl:
            parser.error("give bench/gpu_check.py's JSON lines files, or --backward")
        return check(args.jsonl)
    if args.jsonl:
        parser.error("--backward replays a step and reads no file: drop the file names")
    for key, default in REPLAY_FLAGS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches {args.batches}: give batch sizes separated by commas, "
                     f"e.g. 16,64,128")
    if min(batches) < 2:
        parser.error("--batches: at least 2 each (BatchNorm needs two values per channel)")
    try:
        return replay(args.model, args.image_size, batches, args.amp)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
