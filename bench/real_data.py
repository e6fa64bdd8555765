"""Test accuracy on Fashion-MNIST, a real dataset, against the published table.

    sudo apt-get install dataset-fashion-mnist     # the four IDX files, 30 MB
    python bench/real_data.py                      # mnist_net and resnet18, DDP, 2 processes

Each row is one `torchrun --nproc-per-node N ddp_train.py --dataset fashion-mnist` run; the
table gives its test accuracy after every epoch and its wall time, beside the figures that
Fashion-MNIST's own README (/usr/share/doc/dataset-fashion-mnist/README.md.gz) publishes for
similar models. Prints a markdown table, with the machine and versions, to paste into
bench/results/.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torchvision  # noqa: E402

from training import contract  # noqa: E402

# From Fashion-MNIST's README, the rows closest to our two models (test accuracy)
PUBLISHED = {
    "mnist_net": "2 Conv+pooling: 0.876 (Kashif Rasul) to 0.916 (TensorFlow's tutorial); "
                 "3 Conv+pooling+2 FC+dropout: 0.926",
    "resnet18": "ResNet18 with normalization, flips, translation and rotation: 0.949",
}


def run(model: str, epochs: int, lr: float, step_size: int, nproc: int, batch: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(REPO / "ddp_train.py"), "--dataset",
           "fashion-mnist", "--model", model, "--epochs", str(epochs), "--lr", str(lr),
           "--step-size", str(step_size), "--batch-size", str(batch), "--log-every", "0"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
    rows = [m for m in map(contract.parse_metric_line, proc.stdout.splitlines()) if m]
    epochs_rows = [r for r in rows if not r.get("final")]
    return {"command": "torchrun " + " ".join(cmd[3:]).replace(str(REPO) + "/", ""),
            "seconds": seconds,
            "accuracy": [float(r["val_acc"]) for r in epochs_rows],
            "epoch_s": [float(r["epoch_time_s"]) for r in epochs_rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", nargs=4, action="append", metavar=("MODEL", "EPOCHS", "LR", "STEP"),
                   help="one row: model, epochs, learning rate, --step-size (default: "
                        "mnist_net 6 0.03 3 and resnet18 5 0.05 3)")
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc-per-node)")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    args = p.parse_args()
    runs = args.run or [["mnist_net", "6", "0.03", "3"], ["resnet18", "5", "0.05", "3"]]
    cpu = platform.processor() or platform.machine()
    print(f"Machine: {platform.node()}, {os.cpu_count()} CPUs ({cpu}), "
          f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}"
          f"; Python {platform.python_version()}, torch {torch.__version__}, torchvision "
          f"{torchvision.__version__}; {time.strftime('%Y-%m-%d')}\n")
    print("| model | epochs | test accuracy after each epoch (%) | final | wall time | "
          "published (Fashion-MNIST's README) |")
    print("|---|---:|---|---:|---:|---|")
    commands = []
    for model, epochs, lr, step in runs:
        r = run(model, int(epochs), float(lr), int(step), args.nproc, args.batch_size)
        commands.append(r["command"])
        curve = ", ".join(f"{a:.2f}" for a in r["accuracy"])
        print(f"| {model} | {epochs} | {curve} | **{r['accuracy'][-1]:.2f}** | "
              f"{r['seconds'] / 60:.1f} min ({sum(r['epoch_s']) / len(r['epoch_s']):.0f} s "
              f"per epoch) | {PUBLISHED.get(model, '-')} |", flush=True)
    print("\nCommands:\n" + "\n".join(f"    {c}" for c in commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
