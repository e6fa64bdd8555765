"""Where a traced step's GPU time goes, by kind of kernel: the GPU work in the trace that
--profile writes (DIR/profile_trace_rank0.json), summed per kind and per step, with the
longest kernels.

    python ddp_train.py --model resnet50 --data-on-device --image-size 224 --profile prof
    python bench/kernel_time.py prof/profile_trace_rank0.json

The [PROFILE] line says how much of a step the GPU computes; this says which work that is. On
an H200 (ResNet-50, bf16, 224 px, batch 256; bench/results/gpu-h200-2026-11-28.md) batch norm
was 45% of the eager step's 54.5 ms of GPU work and the convolutions 22%; --compile fuses batch
norm, ReLU and the residual adds into Triton kernels, and the step's GPU work fell to 37.9 ms.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
import zlib
from collections import Counter

COMMUNICATION = "communication (NCCL; overlaps the rest)"
# the kinds, in the order a kernel's name is tried against them: the first that matches
KINDS = [
    # collectives run on their own stream, beside the compute: shown, not added to the step
    (COMMUNICATION, r"nccl"),
    ("fused by torch.compile (Triton)", r"^triton_"),
    # cuDNN's own batch norm (fp16 and fp32 inputs) is named cudnn::bn_...: before convolution
    ("batch norm", r"batch_norm|batchnorm|welford|\bbn_(fw|bw)"),
    ("convolution", r"conv|implicit_gemm|xmma_(fprop|dgrad|wgrad)|cudnn|nchwtonhwc|nhwctonchw"),
    # cuBLAS kernels: on ResNet-50 mostly its 1x1 convolutions, run as GEMMs, and the FC layer
    ("matrix multiply", r"gemm|cutlass|nvjet|cublas"),
    ("optimizer", r"multi_tensor_apply|fused_sgd|fused_adam|foreach"),
    # ReLU runs as clamp_min forward and threshold_backward backward
    ("ReLU", r"relu|threshold|clamp"),
    ("pooling", r"pool"),
    ("elementwise and copies", r"elementwise|copy|fill|index|gather|scatter|cat_"),
    ("reduction", r"reduce"),
]
COPIES = {"gpu_memcpy": "memory copies", "gpu_memset": "memory sets"}


def kind_of(name: str) -> str:
    """The kind of a kernel by its name (case does not matter); "other" where none fits."""
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def gpu_events(trace: dict) -> list:
    """The GPU's own work in a Chrome trace: kernels, copies and sets (complete events with a
    name and a duration in microseconds, a number 0 or more)."""
    def is_duration(value) -> bool:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value >= 0)

    return [e for e in trace["traceEvents"]
            if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in ("kernel", *COPIES)
            and isinstance(e.get("name"), str) and is_duration(e.get("dur"))]


def breakdown(events: list, steps: int) -> tuple:
    """(ms a step per kind, ms a step per (kind, kernel name)), each largest first."""
    kinds, names = Counter(), Counter()
    for e in events:
        kind = kind_of(e.get("name", "")) if e["cat"] == "kernel" else COPIES[e["cat"]]
        kinds[kind] += e["dur"] / 1000 / steps  # the trace's times are microseconds
        names[kind, e.get("name", "?")] += e["dur"] / 1000 / steps
    return kinds.most_common(), names.most_common()


def read_trace(path: str) -> dict:
    """The trace at ``path`` (JSON, or JSON that gzip compressed, whatever its name);
    SystemExit with one sentence where it is missing or no trace."""
    fix = "give the profile_trace_rank0.json that --profile DIR wrote into DIR"
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:2] == b"\x1f\x8b":  # gzip's magic number
            data = gzip.decompress(data)
        trace = json.loads(data)
    except FileNotFoundError:
        sys.exit(f"error: {path} does not exist: {fix}")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        sys.exit(f"error: {path} is not a readable trace ({type(e).__name__}: "
                 f"{str(e).splitlines()[0] if str(e) else 'cut short'}): {fix}")
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        sys.exit(f"error: {path} is JSON but no Chrome trace (no list of traceEvents): {fix}")
    return trace


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="the trace --profile DIR wrote: DIR/profile_trace_rank0.json "
                                 "(or that file gzipped)")
    p.add_argument("--steps", type=int, default=5,
                   help="steps the trace holds: the steps= of the run's [PROFILE] line "
                        "(default: 5, --profile's window)")
    p.add_argument("--top", type=int, default=10, help="longest kernels listed (default: 10)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.top < 0:
        p.error("--steps must be 1 or more and --top 0 or more")
    trace = read_trace(args.trace)
    events = gpu_events(trace)
    if not events:
        print(f"error: {args.trace} holds no GPU kernel with a duration: a trace taken on the "
              f"CPU has none; a --profile run on a GPU records them", file=sys.stderr)
        return 1
    kinds, names = breakdown(events, args.steps)
    total = sum(ms for kind, ms in kinds if kind != COMMUNICATION)
    if total <= 0:
        print(f"error: {args.trace}'s GPU kernels take no time (every duration is 0): trace "
              f"a run that trains, with --profile", file=sys.stderr)
        return 1
    print(f"{args.trace}: {total:.1f} ms of GPU work a step over {args.steps} step(s) "
          f"({len(events) / args.steps:,.0f} kernels, copies and sets a step)")
    print(f"{'kind':<40} {'ms/step':>8} {'share':>7}")
    for kind, ms in kinds:
        share = "" if kind == COMMUNICATION else f"{ms / total:.1%}"
        print(f"{kind:<40} {ms:8.2f} {share:>7}")
    if args.top:
        print("longest kernels (ms a step, all their launches):")
        for (kind, name), ms in names[:args.top]:
            print(f"{ms:8.2f}  [{kind}] {name[:100]}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # its output cut short by a pipe (| head): nothing to say
        sys.stderr.close()
        sys.exit(1)
