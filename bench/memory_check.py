"""The memory model against the GPU's measurements, on any machine: every training row that
bench/gpu_check.py measured (its JSON lines: the command, torch.cuda.max_memory_allocated's
peak, the prediction of its day), predicted again by the model as it is now (the row's command
with --estimate-memory 1, on this CPU), and the errors then and now.

    python bench/memory_check.py bench/results/gpu-h200-2026-11-27b.jsonl \\
        bench/results/gpu-h200-2026-11-28.jsonl
    python bench/memory_check.py --backward --image-size 64 --batches 16,64,128

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
from training.memory import MIB, WORKSPACE  # noqa: E402

SCRIPTS = ("ddp_train.py", "fsdp_train.py", "dp_train.py")


class BadFile(Exception):
    """A file that is not gpu_check's JSON lines: its sentence."""


def read_rows(paths: list) -> list:
    """The training rows with a measured peak on a GPU, in file order."""
    rows = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise BadFile(f"cannot read {path} ({getattr(err, 'strerror', None) or err}): give "
                          f"the JSON lines file bench/gpu_check.py wrote beside its --out")
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise BadFile(f"{path}, line {number}, is not a JSON line: give the file "
                              f"bench/gpu_check.py wrote beside its --out") from None
            if not isinstance(row, dict):
                raise BadFile(f"{path}, line {number}, is not a row of bench/gpu_check.py")
            if row.get("kind") == "train" and row.get("device") == "cuda" and row.get("peak"):
                rows.append(row)
    return rows


def row_command(row: dict) -> tuple:
    """(script, its flags) of a row's command, with the row's --amp (a GPU's default)."""
    words = shlex.split(row["cmd"])
    at = next(i for i, w in enumerate(words) if Path(w).name in SCRIPTS)
    flags = words[at + 1:]
    if "--amp" not in flags:
        flags += ["--amp", row["amp"]]
    return Path(words[at]).name, flags


def predict(script: str, flags: list) -> tuple:
    """(the [MEMORY] figures of the run's own variant at one GPU, or None; why not)."""
    proc = subprocess.run([sys.executable, str(REPO / script), *flags, "--estimate-memory", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return None, (proc.stderr.strip().splitlines() or ["no message"])[-1]
    module = importlib.import_module(script[:-3])
    variant = module.memory_variant(module.build_parser().parse_args(flags))
    for line in proc.stdout.splitlines():
        parsed = contract.fields(line, contract.MEMORY_PREFIX + " ")
        if parsed and parsed[0].get("variant") == variant:
            return {k: float(v) for k, v in parsed[0].items() if contract.is_number(v)}, ""
    return None, f"no [MEMORY] line for variant {variant}"


def eager(row: dict) -> bool:
    """A row without CUDA graphs or torch.compile, whose allocations are the model's own."""
    return not any(flag in row["cmd"] for flag in ("--cuda-graph", "--compile"))


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
        key = row_command(row)
        key = (key[0], tuple(key[1]))
        if key not in predicted:
            predicted[key] = predict(key[0], list(key[1]))
        figures, why = predicted[key]
        then = row.get("predicted")
        cells = [row["label"], row["image"], row["batch"], f"{row['peak']:,.0f}"]
        cells += [f"{then:,.0f}", f"{then / row['peak'] - 1:+.1%}"] if then else ["", ""]
        if figures is None:
            cells += [f"not predicted here: {why}", ""]
        else:
            now = figures["peak_mib"]
            cells += [f"{now:,.0f}", f"{now / row['peak'] - 1:+.1%}"]
            within["now"] += abs(now / row["peak"] - 1) <= 0.05
            within["predicted"] += 1
            if eager(row):  # what the step held beside the parts the model counts
                implied[key] = row["peak"] - (now - figures.get("workspace_mib", 0))
        within["then"] += bool(then) and abs(then / row["peak"] - 1) <= 0.05
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"\nwithin 5%: {within['then']} of {len(rows)} rows then; now {within['now']} of the "
          f"{within['predicted']} predicted here (workspace {WORKSPACE / MIB:.0f} MiB)")
    if implied:
        values = sorted(implied.values())
        print(f"beside the counted parts the eager rows' {len(values)} configurations held "
              f"{', '.join(f'{v:.0f}' for v in values)} MiB: median "
              f"{statistics.median(values):.0f}")
    return 0


def replay(model_name: str, side: int, batches: list, amp: str) -> int:
    """One training step on the CPU per batch, every storage it makes followed to its end."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from training import memory, models

    class Live(TorchDispatchMode):
        """The bytes of the storages the ops made that are still alive, and their most."""

        def __init__(self, batch: int):
            super().__init__()
            self.batch, self.live, self.peak, self.sizes = batch, 0, 0, {}

        def _gone(self, key: int) -> None:
            self.live -= self.sizes.pop(key)[0]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key not in self.sizes:
                        images = t.dim() > 0 and t.shape[0] == self.batch
                        self.sizes[key] = (storage.nbytes(), images)
                        self.live += storage.nbytes()
                        weakref.finalize(storage, self._gone, key)
            self.peak = max(self.peak, self.live)
            return out

    torch.manual_seed(0)
    model = models.build_model(model_name, 200, (3, side, side)).train()
    saved = memory.saved_for_backward(model, (3, side, side), amp)
    print(f"{model_name}, {side}x{side} pixels, --amp {amp}: MiB on the CPU")
    print(f"{'batch':>6}{'saved (model)':>15}{'saved (replay)':>16}{'backward peak':>15}"
          f"{'peak - saved':>14}{'2 x largest':>13}")
    for batch in batches:
        images, labels = torch.randn(batch, 3, side, side), torch.randint(0, 200, (batch,))
        for p in model.parameters():  # the gradients exist already, as DDP's buckets do
            p.grad = torch.zeros_like(p)
        live = Live(batch)
        with live:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp != "off"):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            after_forward = live.live
            largest = max((n for n, imgs in live.sizes.values() if imgs), default=0)
            loss.backward()
        del loss
        counted = saved.per_image * batch + saved.fixed
        print(f"{batch:>6}{counted / MIB:>15.1f}{after_forward / MIB:>16.1f}"
              f"{live.peak / MIB:>15.1f}{(live.peak - after_forward) / MIB:>14.1f}"
              f"{2 * largest / MIB:>13.1f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", nargs="*", help="bench/gpu_check.py's JSON lines files")
    parser.add_argument("--backward", action="store_true",
                        help="replay training steps on the CPU instead (no files)")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batches", default="16,64,128",
                        help="comma-separated batch sizes for --backward (default 16,64,128)")
    parser.add_argument("--amp", choices=("bf16", "off"), default="bf16")
    args = parser.parse_args(argv)
    if args.backward:
        try:
            batches = [int(b) for b in args.batches.split(",")]
        except ValueError:
            parser.error(f"--batches {args.batches}: give batch sizes separated by commas, "
                         f"e.g. 16,64,128")
        if min(batches) < 2:
            parser.error("--batches: at least 2 each (BatchNorm needs two values per channel)")
        return replay(args.model, args.image_size, batches, args.amp)
    if not args.jsonl:
        parser.error("give bench/gpu_check.py's JSON lines files, or --backward")
    return check(args.jsonl)


if __name__ == "__main__":
    sys.exit(main())
