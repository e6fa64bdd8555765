"""The plain PyTorch training step with nothing of the toolkit around it: the yardstick that
ddp_train.py --data-on-device (eager) and --cuda-graph are held against.

    python bench/raw_step.py --mode eager                  # ResNet-50, 64 px, batch 256
    python bench/raw_step.py --mode graph                  # the whole step in one CUDA graph
    python bench/raw_step.py --mode eager --device cpu --model resnet18 --batch-size 8 --steps 3

What it runs is what ddp_train.py's step runs, without DDP, loader or metrics: the same model
(training/models.py, seeded as the scripts seed it) in the same memory format (channels_last on
CUDA), the same autocast dtype (bf16 on GPUs of compute capability 8.0 and newer, fp16 with a
GradScaler on older ones, none on the CPU), the same SGD (momentum, weight decay and learning
rate at the scripts' defaults; fused on CUDA, its momentum made before the first step), and the
same input: one static batch of float32 images, normalised, in the model's memory format, with
int64 labels, made once on the device.

--mode eager calls the step in a plain loop. --mode graph runs --warmup steps on a side stream
(cuDNN picks its kernels), captures one step (forward, backward, optimizer step) in a
torch.cuda.CUDAGraph and replays it. As in --cuda-graph, the learning rate is a device tensor
the fused step reads; here nothing is copied into the graph's inputs between replays (the batch
is static), which is the ideal --cuda-graph approaches.

Timing: the device is synchronised before the first timed step and after the last one; the
warm-up (and the capture) stays outside. One machine line ([RAW], keys RAW_KEYS), one line for
people. Exit 2, with one sentence, for a setting that cannot run (--mode graph without a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from training import flags, measure, models, schedule  # noqa: E402
from training.faults import UsageError  # noqa: E402

RAW_PREFIX = "[RAW]"
# what gpu_check.py reads from the [RAW] line
RAW_KEYS = ("mode", "model", "image", "batch", "steps", "amp", "img_per_s", "ms_per_step",
            "peak_mib")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=flags.HelpFormatter)
    p.add_argument("--mode", choices=("eager", "graph"), default="eager",
                   help="eager: the step called in a plain loop; graph: the whole step "
                        "(forward, backward, optimizer step) captured in one CUDA graph and "
                        "replayed (CUDA only)")
    p.add_argument("--model", default="resnet50",
                   help="a model of training/models.py: resnet50, cnn, mnist_net or a "
                        "torchvision classification model such as resnet18")
    p.add_argument("--image-size", type=int, default=None,
                   help="side of the square input images in pixels (default: the model's "
                        "synthetic size, as in ddp_train.py: 64 for ResNet-50; cnn and "
                        "mnist_net take only their own)")
    p.add_argument("--batch-size", type=int, default=256, help="images per step")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed steps first (cuDNN's autotuning); graph: before the capture")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when a GPU is visible, else cpu")
    return p


def build_step(model: nn.Module, optimizer, scaler, dtype, device: torch.device):
    """ddp_train.py's train_step without DDP and without --clip-grad-norm (off by default)."""
    criterion = nn.CrossEntropyLoss()

    def step(images, labels):
        # zeroed, not dropped: the gradients stay where the captured graph writes them, as with
        # ddp_train.py's default --gradient-as-bucket-view
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = criterion(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss
    return step


def capture(step, optimizer, images, labels, warmup: int) -> torch.cuda.CUDAGraph:
    """PyTorch's whole-network capture: warm up on a side stream, then record one step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(images, labels)
    torch.cuda.current_stream().wait_stream(side)
    # the learning rate as a device tensor the fused step reads, as --cuda-graph captures it
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=images.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(images, labels)
    return graph


def run(args, device: torch.device) -> dict:
    torch.backends.cudnn.benchmark = True  # fixed input shapes, as in the training scripts
    # (C, H, W) and the classes of ddp_train.py's synthetic data for these flags
    shape, classes = flags.input_shape(argparse.Namespace(
        dataset="synthetic", model=args.model, image_size=args.image_size))
    torch.manual_seed(0)
    model = models.build_model(args.model, classes, shape)
    memory_format = models.memory_format(model, device)
    model = model.to(device, memory_format=memory_format)
    defaults = flags.add_common_args(argparse.ArgumentParser())  # the scripts' SGD settings
    optimizer = torch.optim.SGD(model.parameters(), lr=defaults.get_default("lr"),
                                momentum=defaults.get_default("momentum"),
                                weight_decay=defaults.get_default("weight_decay"),
                                fused=schedule.fused_sgd(device))
    schedule.start_momentum(optimizer)
    amp = flags.default_amp(device)  # ddp_train.py's --amp on this device
    dtype = flags.amp_dtype(argparse.Namespace(amp=amp))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    step = build_step(model, optimizer, scaler, dtype, device)
    # one static batch on the device, as the --data-on-device path hands it to the step
    images = torch.randn(args.batch_size, *shape, device=device).contiguous(
        memory_format=memory_format)
    labels = torch.randint(0, classes, (args.batch_size,), device=device)

    # the peak from before the warm-up: a replay allocates nothing, so a reset after the
    # capture would leave the graph's own memory out (423 MiB reported on an H200 for a step
    # whose eager peak was 1,285)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.mode == "graph":
        graph = capture(step, optimizer, images, labels, args.warmup)
        run_once = graph.replay
    else:
        for _ in range(args.warmup):
            step(images, labels)

        def run_once():
            step(images, labels)
    measure.synchronize(device)  # the warm-up's work is done before the clock starts
    t0 = time.perf_counter()
    for _ in range(args.steps):
        run_once()
    measure.synchronize(device)  # and the last step's before it stops
    seconds = time.perf_counter() - t0
    return {"mode": args.mode, "model": args.model, "image": shape[-1],
            "batch": args.batch_size, "steps": args.steps,
            "amp": amp,
            "img_per_s": f"{args.batch_size * args.steps / seconds:.1f}",
            "ms_per_step": f"{1e3 * seconds / args.steps:.3f}",
            "peak_mib": f"{measure.peak_memory_mib(device):.1f}"}


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.batch_size, args.steps, args.image_size or 1) < 1 or args.warmup < 0:
        p.error("--batch-size, --steps and --image-size must be above 0, --warmup at least 0")
    gpu = torch.cuda.is_available()
    if args.device == "cuda" and not gpu:
        p.error("--device cuda was given and no GPU is visible: drop --device to run on the CPU")
    on_gpu = (args.device or ("cuda" if gpu else "cpu")) == "cuda"
    # one process on the first GPU, by index: torch.cuda.set_device refuses a bare "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if args.mode == "graph" and device.type != "cuda":
        why = "--device cpu was given" if args.device == "cpu" else "no GPU is visible"
        p.error(f"--mode graph captures the step in a CUDA graph and {why}: use --mode eager "
                f"on the CPU")
    if args.mode == "graph" and args.warmup < 1:
        p.error("--mode graph needs --warmup 1 or more: the capture records the kernels the "
                "warm-up chose")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"raw step: torch {torch.__version__}, CUDA {torch.version.cuda or 'n/a'}, {where}",
          flush=True)
    try:
        result = run(args, device)
    except UsageError as err:  # a model that cannot take these images
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{RAW_PREFIX} " + " ".join(f"{key}={result[key]}" for key in RAW_KEYS))
    print(f"{result['model']}, {result['image']} px, batch {result['batch']}, {result['amp']}, "
          f"{result['mode']}: {float(result['img_per_s']):,.0f} img/s, "
          f"{float(result['ms_per_step']):.2f} ms a step over {result['steps']} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
