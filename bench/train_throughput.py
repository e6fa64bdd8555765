"""Training images/s of ddp_train.py with each input path, and of a plain loop, in one run.

    python bench/train_throughput.py --data-dir /data/tiny-imagenet-200            # one GPU
    python bench/train_throughput.py --data-dir /tmp/tin --model resnet18 --steps 10   # CPU

Rows (same model, batch and step count; steady-state epoch 2 of each run):
    folder     ddp_train.py reading JPEGs with PIL in DataLoader workers (the workshop script's way)
    cache      ddp_train.py --data-cache: uint8 batches, augmentation on the device
    synthetic  ddp_train.py on built-in synthetic data held on the device (--data-on-device):
               no loader, no decoding, no copy: compute only, the ceiling
    plain      a bare loop (model, SGD with ddp_train.py's settings, forward/backward/step,
               nothing else) on the same synthetic data held on the device, timed the same
               way (epoch 2): ddp_train.py's DDP wrapper, logging and metrics should cost
               nothing
If cache is close to synthetic, the input is no longer the limit; folder far below it means
the run is input-bound. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training import contract, datasets, flags, loading, measure, models, schedule  # noqa: E402


def ddp_throughput(args, extra) -> float:
    cmd = [sys.executable, str(REPO / "ddp_train.py"), "--model", args.model, "--batch-size",
           str(args.batch_size), "--epochs", "2", "--max-steps-per-epoch", str(args.steps),
           "--amp", args.amp, *extra]
    if args.num_workers is not None:
        cmd += ["--num-workers", str(args.num_workers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    rows = [m for m in map(contract.parse_metric_line, proc.stdout.splitlines()) if m]
    return float(rows[-1]["throughput_img_s"])  # epoch 2: cudnn's autotuning and caches are warm


def plain_throughput(args) -> float:
    """The bare minimum training loop on the same synthetic data, same device and AMP, timed
    the way ddp_train.py times an epoch: two epochs of ``--steps`` steps, the second measured
    from before its first batch is fetched to a device sync after its last step."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    shape, classes = models.synthetic_shape(args.model)
    model = models.build_model(args.model, classes, shape).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    d = flags.add_common_args(argparse.ArgumentParser()).parse_args([])  # ddp_train's SGD
    sgd = torch.optim.SGD(model.parameters(), lr=d.lr, momentum=d.momentum,
                          weight_decay=d.weight_decay, fused=schedule.fused_sgd(device))
    opt = schedule.start_momentum(sgd)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    data = datasets.SyntheticImages(args.batch_size * args.steps, shape, classes, 0, "train")
    batches = loading.DeviceResident(data, torch.utils.data.RandomSampler(data), args.batch_size,
                                     True, device)  # as ddp_train.py --data-on-device
    finish = datasets.DeviceAugment(*datasets.NORMALIZE["synthetic"], crop_flip=False)
    model.train()
    for epoch in range(2):
        measure.synchronize(device)
        t0, n = time.perf_counter(), 0
        for x, y in batches:
            x = finish(x, train=True)  # uint8 samples normalised on the device, as ddp_train's
            if device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype or torch.float32,
                                enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            n += y.size(0)
        measure.synchronize(device)
        seconds = time.perf_counter() - t0
    return n / seconds  # the second epoch


def plain_in_subprocess(args) -> float:
    """plain_throughput in a fresh process, started like the ddp_train.py runs (a loop inside
    this already-warm process measured 15% faster than the same loop started fresh)."""
    cmd = [sys.executable, __file__, "--plain-only", "--data-dir", args.data_dir, "--model",
           args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--amp", args.amp]
    if args.num_workers is not None:
        cmd += ["--num-workers", str(args.num_workers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.split()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="TinyImageNet folder (original layout)")
    p.add_argument("--model", default="resnet50", help="model (resnet50 = the workshop's)")
    p.add_argument("--batch-size", type=int, default=256, help="batch size")
    p.add_argument("--steps", type=int, default=50, help="training steps measured per run")
    p.add_argument("--amp", default="fp16" if torch.cuda.is_available() else "off",
                   choices=("fp16", "bf16", "off"), help="mixed precision")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers (default: the training script's default)")
    p.add_argument("--cache-dir", default="auto", help="where the uint8 cache lives or goes")
    p.add_argument("--plain-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each row, interleaved; the table shows the median")
    args = p.parse_args(argv)
    if args.plain_only:  # one measurement, for plain_in_subprocess
        print(f"plain {plain_throughput(args):.3f}")
        return 0
    if not Path(args.data_dir).is_dir():
        print(f"error: --data-dir {args.data_dir} does not exist: point it at a TinyImageNet "
              f"folder (tests/make_tinyimagenet.py makes a small one)", file=sys.stderr)
        return 2
    data = ["--data-dir", args.data_dir]
    runs = {
        "folder (JPEG + PIL per image)": lambda: ddp_throughput(args, data),
        "cache (uint8 + device augmentation)":
            lambda: ddp_throughput(args, data + ["--data-cache", args.cache_dir]),
        "synthetic on device (compute only)": lambda: ddp_throughput(
            args, ["--data-on-device", "--synthetic-size", str(args.batch_size * args.steps)]),
        "plain loop, synthetic on device": lambda: plain_in_subprocess(args),
    }
    samples = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every row
        for name, run in runs.items():
            samples[name].append(run())
    rows = [(name, statistics.median(v)) for name, v in samples.items()]
    synthetic = rows[2][1]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU {platform.processor() or platform.machine()} ({len(os.sched_getaffinity(0))} cores)"
    print(f"model {args.model}, batch {args.batch_size}, {args.steps} steps, amp {args.amp}, "
          f"{device}, torch {torch.__version__}, median of {args.repeats} interleaved runs")
    print()
    print("| input | training img/s (median) | vs synthetic | all runs |")
    print("|---|---:|---:|---|")
    for name, value in rows:
        runs_text = ", ".join(f"{v:.1f}" for v in samples[name])
        print(f"| {name} | {value:.1f} | {value / synthetic:.2f}x | {runs_text} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
