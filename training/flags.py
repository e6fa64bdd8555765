"""The flags every training script shares: their definitions (``add_common_args``), their
checks (``check_flags``: one sentence naming the fix), their resolved defaults
(``resolve_args``: workers, precision, paths). What the flags then drive lives with its
job: the learning-rate schedule and the optimizer's settings in schedule.py, each rank's seed
in distributed.py, what --amp does on this CPU in devices.py.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

import torch

from training import allocation, board, checkpoint, contract, devices, schedule
from training.distributed import DistEnv, print0
from training.faults import UsageError, make_folder
from training.models import check_model, grey_channels, synthetic_shape


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
DATASETS = ("tinyimagenet", "cifar10", "mnist", "fashion-mnist", "synthetic")
# --estimate-memory without N: 1, 2, 4 and 8 GPUs. Not a number (nor a string, which argparse
# would convert), so that no N typed on the command line (-1 was) can mean it.
ALL_GPU_COUNTS = (1, 2, 4, 8)
MAX_DIST_TIMEOUT = 86400  # seconds; far beyond it, gloo's and NCCL's own timers overflow
KEEP_CHECKPOINTS = 2  # --keep-checkpoints' default
TENSORBOARD_EVERY = 5  # --tensorboard-every's default, in seconds
SYNTHETIC_SIZE = 2048  # --synthetic-size's default
MAX_SYNTHETIC = 10**8  # --synthetic-size's largest (TinyImageNet has 10**5 images)
MAX_EPOCHS = 10**6  # --warmup-epochs' largest
DEFAULT_MODEL = {"tinyimagenet": "resnet50", "cifar10": "cnn", "mnist": "mnist_net",
                 "fashion-mnist": "mnist_net", "synthetic": "resnet50"}
# --clip-grad-norm's default per model; 0 (off) for the others. The CIFAR CNN has no BatchNorm
# and no dropout: on easy data (the built-in synthetic) its loss reaches 0, its logits keep
# growing, and one large gradient then kills its ReLUs for good (loss back at chance, 10%
# accuracy, at 2 threads per rank; issue 49). Its gradient norm stays below 4 while it learns,
# so a clip at 1 bounds only such spikes, at no cost in speed. ResNet-50's norm is about 5.5 from
# the start: a clip at 1 would cut its learning rate several times over, so it stays off there.
DEFAULT_CLIP_GRAD_NORM = {"cnn": 1.0}


def positive(text: str) -> float:
    """An argparse type: a number above 0 and below 1e12, for a strategy's own flags (the
    shared ones are checked in check_flags, whose sentences also name the fix); a larger one
    (1e308) overflowed where torch made it an integer, a traceback."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1e12:
        raise argparse.ArgumentTypeError(f"must be a number above 0 and below 1e12, got "
                                         f"{text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type like positive: a whole number above 0 (e.g. dp_train.py's --gpus)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, got {text!r}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help ends each flag's text with its default, but not "(default: None)": its text says."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every training script takes, with the same names, defaults and meaning."""
    g = parser.add_argument_group("data and model")
    g.add_argument("--data-dir", default=os.environ.get("DATA_DIR") or None,
                   help="dataset root (default: $DATA_DIR). For TinyImageNet the folder holding "
                        "wnids.txt, train/ and val/ in the original layout; for Fashion-MNIST "
                        "the folder of its four IDX files (default: the dataset-fashion-mnist "
                        "package's /usr/share/datasets/fashion-mnist)")
    g.add_argument("--dataset", choices=DATASETS, default=None,
                   help="default: tinyimagenet when a data dir is given, else synthetic "
                        "(built-in, learnable, no download)")
    g.add_argument("--model", default=None,
                   help="resnet50, cnn (CIFAR-10 CNN), mnist_net, or any torchvision "
                        "classification model name; default follows the dataset "
                        "(tinyimagenet/synthetic: resnet50, cifar10: cnn, mnist and "
                        "fashion-mnist: mnist_net). On Fashion-MNIST a 3-channel model gets "
                        "the grey channel repeated three times")
    g.add_argument("--data-cache", nargs="?", const="auto", default=None, metavar="DIR",
                   help="TinyImageNet only: decode each split once into a memory-mapped uint8 "
                        "array in DIR (no DIR: a folder beside the data dir, or ~/.cache when "
                        "that is read-only) and augment batches on the device; far faster than "
                        "decoding JPEGs every epoch")
    g.add_argument("--data-on-device", action="store_true",
                   help="hold each rank's data on its device and make batches there: no "
                        "DataLoader, no host-to-device copy per step (needs --data-cache or "
                        "synthetic data; the cache: the rank's samples of the epoch, 1/world "
                        "of TinyImageNet's 1.2 GB uint8 train split; synthetic: made per "
                        "batch; the [MEMORY] line's data_mib)")
    g.add_argument("--synthetic-size", type=int, default=SYNTHETIC_SIZE,
                   help="training samples of the synthetic dataset (validation gets a quarter)")
    g.add_argument("--image-size", type=int, default=None, metavar="N",
                   help="TinyImageNet and synthetic data: train on N x N images, resized from "
                        "the native 64 x 64 (on the device per batch with --data-cache, in the "
                        "loader otherwise). 224 is the workshop seed's setting: 12 times the "
                        "pixels, and about 12 times the activation memory")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=3, help="number of epochs")
    g.add_argument("--batch-size", type=int, default=contract.DEFAULT_BATCH_SIZE,
                   help="batch size PER PROCESS/GPU; the global batch is this times the number "
                        "of GPUs and is printed at start")
    g.add_argument("--lr", type=float, default=0.01,
                   help="SGD learning rate (for a global batch of --base-batch when "
                        "--lr-scaling is linear or sqrt)")
    g.add_argument("--lr-scaling", choices=("none", "linear", "sqrt"), default="none",
                   help="scale --lr with the global batch: linear (x global / base batch, the "
                        "rule of Goyal et al., 2017) or sqrt; none keeps --lr at every world "
                        "size (the workshop script's behaviour)")
    g.add_argument("--base-batch", type=int, default=contract.DEFAULT_BATCH_SIZE,
                   help="the global batch that --lr is meant for under --lr-scaling: one GPU "
                        "at the default --batch-size")
    g.add_argument("--warmup-epochs", type=float, default=0,
                   help="raise the learning rate linearly, step by step, over this many epochs "
                        "(fractions allowed) to its full value; 0: no warm-up")
    g.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="before each optimizer step, scale the gradients down so that their "
                        "global norm (all parameters, all ranks) is at most MAX, as timm's "
                        "--clip-grad and torchtitan's max_norm do; 0: off. Default: 1.0 for "
                        "--model cnn (without it, its loss can reach 0 on the synthetic data "
                        "and then explode), off for the other models")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    g.add_argument("--step-size", type=int, default=2,
                   help="step decay: multiply the learning rate by --gamma every this many epochs")
    g.add_argument("--gamma", type=float, default=0.1,
                   help="multiply the learning rate by this every --step-size epochs")
    g.add_argument("--amp", choices=("fp16", "bf16", "off"), default=None,
                   help="mixed precision: fp16 (autocast + GradScaler), bf16 (autocast, no "
                        "scaler) or off; default bf16 on GPUs of compute capability 8.0+ (A100, "
                        "H100), fp16 on older GPUs (V100), off on CPU")
    g.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   choices=COMPILE_MODES,
                   help="torch.compile the model, in MODE (no MODE: default; reduce-overhead "
                        "adds CUDA graphs of its own, max-autotune-no-cudagraphs tries more "
                        "kernels at a longer compilation). The first epoch holds the "
                        "compilation (45 to 65 s for ResNet-50 on an H200) and its evaluation "
                        "one more (eval mode); later epochs run compiled, without recompiling. "
                        "Measured on an H200: at 224 px, batch 256, 1.42x the eager step "
                        "(reduce-overhead 1.45x); at 64 px, batch 1024, reduce-overhead 1.91x "
                        "(bench/results/gpu-h200-2026-11-28.md)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="GPU: after a few eager steps (11 under DDP), capture the whole training "
                        "step (forward, "
                        "backward with its all-reduce, optimizer step) as one CUDA graph and "
                        "replay it for every later batch: one launch a step instead of about a "
                        "thousand, for when the GPU computes a step faster than Python launches "
                        "it (small images or per-GPU batches on A100/H100-class GPUs). "
                        "ddp_train.py, and dp_train.py on one GPU; not with --compile or "
                        "ZeRO-1")
    g = parser.add_argument_group("run")
    g.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers per process (default: the CPUs this process "
                        "may use, no more than $SLURM_CPUS_PER_TASK, under torchrun shared "
                        "by the node's processes, minus one for the main process, at most 8; "
                        "at least 1 on a GPU)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for model init, shuffling and synthetic data")
    g.add_argument("--max-steps-per-epoch", type=int, default=0,
                   help="stop each training epoch after this many steps (0 = whole epoch); "
                        "for smoke runs and benchmarks")
    g.add_argument("--save-model", default=None, metavar="PATH",
                   help="at the end rank 0 saves the unwrapped model's state_dict here, as CPU "
                        "tensors (load with torch.load(PATH, weights_only=True), on any machine)")
    g.add_argument("--log-every", type=float, default=30, metavar="SECONDS",
                   help="rank 0 prints a progress line (step, images/s, elapsed, ETA) this "
                        "often, and once after the first steps (within 10 s); 0: never")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the GPUs torch sees, else the CPU, but a job given GPUs that "
                        "torch cannot use stops with the reason; cuda: GPUs or stop; cpu: train "
                        "on the CPU on purpose, even on a GPU node")
    g.add_argument("--share-gpus", action="store_true",
                   help="allow more processes per node than GPUs (ddp_train.py, fsdp_train.py): "
                        "the ranks share the GPUs round-robin and talk over gloo (NCCL refuses "
                        "two ranks on one GPU). Slow, every collective through host memory: for "
                        "trying the multi-rank code paths with one GPU, not for timing")
    g.add_argument("--dist-timeout", type=int, default=600,
                   help="seconds a collective or the process-group start may wait for other "
                        "ranks before the run fails instead of hanging")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first unreadable image (naming it) instead of skipping it")
    g.add_argument("--profile", nargs="?", const=os.environ.get("RUN_DIR") or ".", default=None,
                   metavar="DIR",
                   help="trace 5 steps of the first epoch with torch.profiler after 3 warm-up "
                        "steps: rank 0 writes DIR/profile_trace_rank0.json (open it in "
                        "ui.perfetto.dev) and prints a [PROFILE] line, the step split into "
                        "compute, exposed communication, data wait and other (DIR: default "
                        "$RUN_DIR under the launchers, else the current directory)")
    g.add_argument("--check", action="store_true",
                   help="run only the preflight checks, an all-reduce sanity test and the "
                        "bandwidth of the strategy's collectives up to the gradient size "
                        "([BANDWIDTH] lines, as nccl-tests report them), then exit")
    g.add_argument("--tensorboard", nargs="?", const="auto", default=board.default_flag(),
                   metavar="DIR",
                   help="rank 0 writes TensorBoard curves to DIR: per step (see "
                        "--tensorboard-every) the loss, learning rate, images/s and data wait; "
                        "per epoch the [METRIC] figures; the configuration and hyperparameters. "
                        "Default DIR: $RUN_DIR/tensorboard under the launchers, where it is on "
                        "unless --tensorboard off; else runs/tensorboard/<strategy>-<nodes>n"
                        "<gpus>g-<the --checkpoint-dir's name, or the time>")
    g.add_argument("--tensorboard-every", type=float, default=TENSORBOARD_EVERY,
                   metavar="SECONDS",
                   help="with --tensorboard: a per-step point at most this often (each reads "
                        "the loss from the device once); 0: every step")
    g.add_argument("--estimate-memory", nargs="?", type=int, const=ALL_GPU_COUNTS, default=None,
                   metavar="N",
                   help="print the predicted memory per GPU of this strategy and its variants, "
                        "by component ([MEMORY] lines and a table) for N GPUs (no N: 1, 2, 4 "
                        "and 8), then exit: no GPU, no process group, no dataset needed")
    g.add_argument("--simulate-world-size", type=int, default=None, metavar="N",
                   help="ddp_train.py and fsdp_train.py, one process: run as rank 0 of N on "
                        "torch's fake process group (collectives move no data, every shard and "
                        "bucket has its real size), train 2 steps and print a [MEMORY-HELD] "
                        "line, what this rank holds (parameters, gradients, optimizer state; "
                        "peak_mib on a GPU), beside the [MEMORY] prediction for N GPUs. A "
                        "memory check, not training: no accuracy, no checkpoint, no model")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save a checkpoint here at the end of every epoch (and every "
                        "--checkpoint-every steps); resume from it with --resume auto")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N training steps (0 = only at epoch ends)")
    g.add_argument("--keep-checkpoints", type=int, default=KEEP_CHECKPOINTS, metavar="K",
                   help="keep the newest K checkpoints, delete older ones")
    g.add_argument("--resume", default="auto", metavar="{auto,never,PATH}",
                   help="auto: continue from the newest usable checkpoint in --checkpoint-dir "
                        "(a fresh start if there is none); never: always start fresh; PATH: "
                        "this checkpoint")
    return parser


def refuse_flags(parser: argparse.ArgumentParser, refusals: dict) -> None:
    """Common flags this script cannot serve ({option: the sentence that refuses it, naming
    the script to use}): left out of --help and its usage line (listing them offered what the
    script cannot do), and refused by check_flags, before anything starts (the process group,
    a simulation's "rank 0 of N" prefix) and in launch/check_args.py."""
    for action in parser._actions:  # argparse's one list of them; no public accessor
        if set(action.option_strings) & set(refusals):
            action.help = argparse.SUPPRESS
    parser.set_defaults(refused_flags=refusals)  # check_flags takes it out of args again


def default_workers(env: DistEnv) -> int:
    """Loader workers per process when --num-workers is not given: the process's share of the
    task's usable CPUs (allocation.usable_cpus) less one for the training, at most 8."""
    total = allocation.usable_cpus()
    # torchrun starts the node's processes inside ONE Slurm task: they share its CPUs.
    # Started by srun directly, each process is its own task with its own CPUs.
    share = total // env.local_world_size if env.source == "torchrun" else total
    return max(0, min(8, share - 1))


#: torchrun's own flags, which a user may write after the script instead of before it
TORCHRUN_FLAGS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank",
                  "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
                  "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--master-addr", "--master_addr",
                  "--master-port", "--master_port", "--standalone", "--max-restarts",
                  "--max_restarts")


def misplaced_torchrun_flag(argv: list, script: str) -> str | None:
    """One sentence for a torchrun flag among a script's own (written after the script, where
    argparse printed its whole usage and "unrecognized arguments"), else None."""
    flag = next((a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in TORCHRUN_FLAGS),
                None)
    if flag is None:
        return None
    if script == "dp_train.py":
        return (f"{flag} is torchrun's, and dp_train.py runs as one process that drives every "
                f"GPU: drop it (python dp_train.py ..., --gpus N picks how many)")
    return (f"{flag} is torchrun's, not {script}'s: put it before the script, as in torchrun "
            f"{flag} ... {script} ...")


def check_flags(args: argparse.Namespace, data_known: bool = True) -> None:
    """Reject impossible flag values, without the machine: run() first thing, check_args.py
    before a job or a study. data_known=False: no --dataset or data dir yet (the job's site.sh
    may set $DATA_DIR), so what depends on the dataset waits for the job."""
    for option, sentence in vars(args).pop("refused_flags", {}).items():  # refuse_flags'
        if getattr(args, option.removeprefix("--").replace("-", "_")):
            raise UsageError(sentence)
    if args.data_dir is not None and not args.data_dir.strip():  # --data-dir "$UNSET_VAR"
        raise UsageError("--data-dir (or $DATA_DIR, its default) is empty (a variable that "
                         "was not set?): give the dataset's folder, or drop --data-dir for "
                         "built-in synthetic data")
    implied = args.dataset is None and args.data_dir  # TinyImageNet, as the user may not know
    if args.dataset is None:
        args.dataset = "tinyimagenet" if args.data_dir else "synthetic"
    if args.model is None:
        args.model = DEFAULT_MODEL[args.dataset]
    if args.clip_grad_norm is None:
        args.clip_grad_norm = DEFAULT_CLIP_GRAD_NORM.get(args.model, 0.0)
    if not 0 <= args.clip_grad_norm < math.inf:
        raise UsageError(f"--clip-grad-norm is the largest gradient norm a step may use, a "
                         f"positive number (1.0 is common) or 0 for no clipping, got "
                         f"{args.clip_grad_norm}")
    for flag in ("epochs", "batch_size", "synthetic_size", "step_size", "base_batch",
                 "keep_checkpoints"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, flag)}")
    for flag in ("num_workers", "max_steps_per_epoch", "checkpoint_every", "log_every", "seed",
                 "momentum", "weight_decay"):  # 0 is allowed: --log-every 0, no progress lines
        if not (getattr(args, flag) or 0) >= 0:  # NaN too; None: resolve_args' default
            raise UsageError(f"--{flag.replace('_', '-')} cannot be negative, got "
                             f"{getattr(args, flag)}")
    if not args.momentum < 1:  # at 1 or more the momentum buffer grows every step
        raise UsageError(f"--momentum must be below 1 (0.9 is common), got {args.momentum}")
    if not args.seed < 2**63:  # torch.Generator's seed is a 64-bit integer
        raise UsageError(f"--seed must be 0 to {2**63 - 1}, got {args.seed}")
    for flag in ("lr", "gamma"):  # the learning rate, and what multiplies it every --step-size
        if not 0 < getattr(args, flag) < math.inf:
            raise UsageError(f"--{flag} must be a positive number, got {getattr(args, flag)}")
    # the optimizer holds them as float32
    schedule.check_float32(args, args.lr, f"--lr {args.lr:g}")
    f32_max = torch.finfo(torch.float32).max
    if not args.weight_decay < f32_max:
        raise UsageError(f"--weight-decay must be below the largest float32 ({f32_max:.3g}), "
                         f"got {args.weight_decay:g} (5e-4 is common)")
    if not 0 <= args.warmup_epochs <= MAX_EPOCHS:  # 1e308: an OverflowError, in steps
        raise UsageError(f"--warmup-epochs must be 0 or a positive number of epochs up to "
                         f"{MAX_EPOCHS:,}, got {args.warmup_epochs}")
    if args.synthetic_size > MAX_SYNTHETIC:  # its labels are made up front: minutes, then RAM
        raise UsageError(f"--synthetic-size is at most {MAX_SYNTHETIC:,} images, got "
                         f"{args.synthetic_size:,}")
    if not 1 <= args.dist_timeout <= MAX_DIST_TIMEOUT:
        raise UsageError(f"--dist-timeout is in seconds and at most {MAX_DIST_TIMEOUT} (a day) "
                         f"and at least 1, got {args.dist_timeout}")
    if args.save_model and args.checkpoint_dir and (
            Path(args.save_model).resolve() == Path(args.checkpoint_dir).resolve()):
        raise UsageError(f"--save-model {args.save_model} is the --checkpoint-dir: give it a "
                         f"file name, e.g. --save-model {Path(args.save_model) / 'model.pt'}")
    if args.save_model and args.resume not in ("auto", "never") and (
            Path(args.save_model).resolve() == Path(args.resume).resolve()):
        raise UsageError(f"--save-model {args.save_model} is the checkpoint --resume reads: "
                         f"the weights alone would replace it; give another file, e.g. "
                         f"--save-model model.pt")
    if args.save_model and re.match(checkpoint.CHECKPOINT_RE, Path(args.save_model).name):
        raise UsageError(f"--save-model {args.save_model} is named like a checkpoint, and "
                         f"--resume auto would take it for one (in a --checkpoint-dir, it can "
                         f"replace this run's own): give it another name, e.g. --save-model "
                         f"model.pt")
    if args.cuda_graph and args.compile:
        raise UsageError("--cuda-graph and --compile each replace the eager step with their own "
                         "graphs: drop one of them")
    if args.profile is not None and args.check:
        raise UsageError("--check is a preflight that trains nothing, so there is nothing for "
                         "--profile to trace: drop one of them")
    if args.image_size is not None:
        if args.dataset not in ("tinyimagenet", "synthetic"):
            raise UsageError(f"--image-size works with TinyImageNet and synthetic data only, "
                             f"not --dataset {args.dataset}: drop --image-size")
        if args.model in ("cnn", "mnist_net"):
            raise UsageError(f"--model {args.model} takes its dataset's fixed image size: drop "
                             f"--image-size, or choose --model resnet50")
        if not 16 <= args.image_size <= 1024:
            raise UsageError(f"--image-size is the side of the square image in pixels, 16 to "
                             f"1024 (64: TinyImageNet's own, 224: ImageNet's), got "
                             f"{args.image_size}")
    board.check_flags(args)
    if args.simulate_world_size is not None:
        if args.simulate_world_size < 2:
            raise UsageError(f"--simulate-world-size N: N is the number of GPUs to simulate, at "
                             f"least 2, got {args.simulate_world_size}")
        clash = [flag for flag, on in (("--check", args.check), ("--profile", args.profile),
                                       ("--checkpoint-dir", args.checkpoint_dir),
                                       ("--save-model", args.save_model),
                                       ("--cuda-graph", args.cuda_graph),
                                       ("--estimate-memory", args.estimate_memory),
                                       ("--tensorboard", args.tensorboard not in (
                                           None, board.OFF, board.UNDER_LAUNCHER))) if on]
        if clash:
            raise UsageError(f"--simulate-world-size only measures the memory of rank 0 of N "
                             f"(its collectives move no data): drop {' and '.join(clash)}")
    # fsdp_train.py's own flag, checked here so that --estimate-memory refuses what training
    # refuses (the other scripts have no --offload)
    if getattr(args, "offload", False) and args.sharding != "full":
        raise UsageError(f"--offload works with --sharding full, not {args.sharding}: drop one "
                         f"of them")
    if args.estimate_memory not in (None, ALL_GPU_COUNTS) and args.estimate_memory < 1:
        raise UsageError(f"--estimate-memory N: N is a number of GPUs, at least 1 (or none: "
                         f"1, 2, 4 and 8), got {args.estimate_memory}")
    shape = input_shape(args, data_known)[0]
    try:
        check_model(args.model, shape)  # before any download or data scan
    except UsageError as e:
        fits = {"cnn": "cifar10", "mnist_net": "mnist"}.get(args.model)
        if not (implied and fits):
            raise
        raise UsageError(f"{e}, or add --dataset {fits} (a data dir, --data-dir or $DATA_DIR, "
                         f"without --dataset is TinyImageNet)") from None
    if not data_known:
        return
    if args.data_on_device and args.dataset == "tinyimagenet" and not args.data_cache:
        raise UsageError("--data-on-device needs decoded data: add --data-cache (TinyImageNet) "
                         "or use the synthetic dataset")
    # Both refusals in one sentence, so that following its advice is enough
    wrong = {}
    if args.data_cache and args.dataset != "tinyimagenet":
        wrong["--data-cache"] = "--data-cache works with TinyImageNet only"
    if args.data_on_device and args.dataset not in ("tinyimagenet", "synthetic"):
        wrong["--data-on-device"] = ("--data-on-device works with TinyImageNet's --data-cache "
                                     "and the synthetic dataset")
    if wrong:
        raise UsageError(f"{'; '.join(wrong.values())}, not --dataset {args.dataset}: drop "
                         f"{' and '.join(wrong)}")


def input_shape(args, data_known: bool = True) -> tuple:
    """(C, H, W) of the images the model gets, and the number of classes, from the flags alone
    (no dataset read): --estimate-memory and the flag checks need them before any data."""
    fixed = {"tinyimagenet": ((3, 64, 64), 200), "cifar10": ((3, 32, 32), 10),
             "mnist": ((1, 28, 28), 10), "fashion-mnist": ((grey_channels(args.model), 28, 28), 10)}
    shape, classes = (data_known and fixed.get(args.dataset)) or synthetic_shape(args.model)
    if args.image_size is not None:
        shape = (shape[0], args.image_size, args.image_size)
    return shape, classes


def resolve_args(args: argparse.Namespace, env: DistEnv, device: torch.device) -> None:
    """Fill the defaults that depend on the device, right after a script chose it and never
    changed afterwards (check_flags filled the rest, right after parsing): --amp (bf16 needs a
    GPU of compute capability 8.0) and --num-workers (at least 1 on a GPU); check the paths
    (check_flags did values)."""
    if args.amp is None:
        args.amp = default_amp(device)
    elif device.type == "cuda" and args.amp == "bf16" and default_amp(device) != "bf16":
        cc = torch.cuda.get_device_capability(device)
        raise UsageError(f"--amp bf16 needs a GPU of compute capability 8.0 or newer (A100, "
                         f"H100, ...); {torch.cuda.get_device_name(device)} has "
                         f"{cc[0]}.{cc[1]}: use --amp fp16")
    elif device.type != "cuda" and args.amp != "off" and env.rank == 0:  # autocast on a CPU
        print(devices.cpu_amp_note(args.amp, devices.cpu_flags()), file=sys.stderr, flush=True)
    given_workers = args.num_workers
    if args.num_workers is None:
        args.num_workers = default_workers(env)
        if device.type == "cuda":  # with 0, reading and pinning a batch delays every step
            args.num_workers = max(1, args.num_workers)
    if args.resume not in ("auto", "never") and not Path(args.resume).exists():
        raise UsageError(f"--resume {args.resume}: no such checkpoint; use auto, never, or the "
                         f"path of a checkpoint file or folder")
    if args.share_gpus and device.type == "cpu" and env.rank == 0:
        print(f"note: --share-gpus does nothing here: the ranks train on the CPU "
              f"({'--device cpu' if args.device == 'cpu' else 'no GPU visible'}), each on its "
              f"own cores; drop --share-gpus", flush=True)
    unsaved = [f"--{name.replace('_', '-')} {value}" for name, value, default in (
        ("checkpoint_every", args.checkpoint_every or 0, 0),
        ("keep_checkpoints", args.keep_checkpoints, KEEP_CHECKPOINTS)) if value != default]
    if unsaved and args.checkpoint_dir is None and env.rank == 0:
        print(f"note: {' and '.join(unsaved)} {'does' if len(unsaved) == 1 else 'do'} nothing "
              f"without --checkpoint-dir: this run saves no checkpoint; add --checkpoint-dir "
              f"DIR", flush=True)
    # flags that act on something this run does not have: said, as the checkpoint ones are
    idle = []
    if args.compile in ("reduce-overhead", "max-autotune") and device.type != "cuda":
        # (--cuda-graph, whose graphs are the step, is refused there)
        idle.append(f"--compile {args.compile}'s CUDA graphs do nothing on the CPU: the step "
                    f"compiles without them, as --compile default")
    if getattr(args, "offload", False) and device.type != "cuda":  # fsdp_train.py's flag
        idle.append("--offload moves nothing on the CPU, where the shards, gradients and "
                    "optimizer state are in host memory already (FSDP's offload code still runs)")
    if args.tensorboard in (None, board.OFF) and args.tensorboard_every != TENSORBOARD_EVERY:
        idle.append(f"--tensorboard-every {args.tensorboard_every:g} does nothing without "
                    f"--tensorboard: add --tensorboard")
    if args.dataset != "synthetic" and args.synthetic_size != SYNTHETIC_SIZE:
        idle.append(f"--synthetic-size {args.synthetic_size} does nothing with --dataset "
                    f"{args.dataset}: it sizes the built-in synthetic data; drop it")
    if args.data_on_device and given_workers:
        idle.append(f"--num-workers {given_workers} does nothing with --data-on-device, which "
                    f"reads no batch through a loader: drop it")
    for line in idle if env.rank == 0 else []:
        print0(f"note: {line}")  # a simulation's with its prefix, as its other lines
    if args.warmup_epochs > args.epochs and env.rank == 0:
        print(f"note: --warmup-epochs {args.warmup_epochs:g} is longer than --epochs "
              f"{args.epochs}: the learning rate never reaches its peak", flush=True)
    if args.profile is not None:
        make_folder(args.profile, "--profile")


def default_amp(device: torch.device) -> str:
    """--amp's default on ``device``: bf16 on GPUs of compute capability 8.0 and newer (bf16
    tensor cores, no GradScaler), fp16 with its GradScaler on older ones (the workshop's, V100
    and before), off on the CPU."""
    if device.type != "cuda":
        return "off"
    return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp16"


def amp_dtype(args) -> torch.dtype | None:
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[args.amp]


AMP_TEXT = {"fp16": "fp16 autocast with GradScaler", "bf16": "bf16 autocast, no GradScaler",
            "off": "off (fp32)"}
