"""The GPU acceptance run's rows (bench/gpu_check.py runs them): what each row runs, at which
size and for how many steps, the order the lanes take them in, and each row's command line."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from training import flags, simulate

CEILING = "ddp, synthetic on device"
GRAPH = "ddp --cuda-graph, synthetic on device"
FSDP = "fsdp full, synthetic on device"
RAW_EAGER = "raw step, eager"  # bench/raw_step.py: the plain step, nothing of the toolkit
RAW_GRAPH = "raw step, whole-step CUDA graph"
WINDOW = 30  # steps an epoch of a row whose figure is no headline: enough for a steady rate
# a guess at each --compile mode's row until one is measured (ResNet-50, a cold cache)
COMPILE_GUESS = {"default": 150, "reduce-overhead": 180, "max-autotune-no-cudagraphs": 300,
                 "max-autotune": 360}
DATA = "data: the TinyImageNet tree and its uint8 cache"  # a job for a lane, not a table row


@dataclass
class Row:
    label: str
    batch: int
    script: str = "ddp_train.py"
    args: list = field(default_factory=list)
    image: int = 64
    cuda_only: bool = False
    needs_data: bool = False  # the TinyImageNet tree and its cache
    need_s: int = 45  # the plan's guess of what it takes on one GPU, before a run measured it
    kind: str = "train"  # or "raw" (bench/raw_step.py), "held" (--simulate-world-size),
    # "profile", "tests", "shared tests", "launcher", "kill-resume", "save-model", "data"
    headline: bool = False  # a target's figure: --steps steps an epoch, not WINDOW
    timed: bool = True  # a training row whose img/s is a figure (--rows memory: the peak is)

    @property
    def key(self) -> str:
        return row_key(self.label, self.image, self.batch)

    @property
    def in_timed_lane(self) -> bool:
        """Whether the row runs in the timed lane, where no other timed row runs beside it."""
        return self.kind in ("train", "raw") and self.timed


def row_key(label: str, image: int, batch: int) -> str:
    """What names one row across runs (a JSON line has the three fields)."""
    return f"{label}, {image} px, batch {batch}"


def plan(which: str, gpu: bool) -> list:
    """The rows of ``which`` (speed, targets, memory, compile, all): the timed rows in the
    order they run, then the untimed ones in the order the lanes take them (the longest
    first)."""
    small, big, huge = (256, 1024, 2048) if gpu else (8, 16, 32)
    side = 224 if gpu else 96  # the seed's setting (the CPU smoke run: smaller)
    synth, graph, profile = ["--data-on-device"], ["--cuda-graph"], ["--profile", "{profile}"]
    wide = ["--image-size", str(side)]
    full = ["--sharding", "full"]
    one_gpu = ["--gpus", "1"] if gpu else []
    # need_s: the plan's guess until a run has measured the row. On the first H200 runs a
    # training row of 100 steps took 21 s (64 px, batch 256) to 74 s (224 px), most of it the
    # process's start and the synthetic data made on the host; the rest is guessed from those
    timed = [
        Row(CEILING, small, args=synth, headline=True, need_s=25),
        Row(GRAPH, small, args=synth + graph, cuda_only=True, headline=True, need_s=25),
        Row(CEILING, big, args=synth, headline=True, need_s=35),
        Row(GRAPH, big, args=synth + graph, cuda_only=True, headline=True, need_s=35),
        Row("ddp fp16 (fused SGD), synthetic on device", small,
            args=synth + ["--amp", "fp16"], cuda_only=True, headline=True, need_s=25),
        # 224 px: what the seed trains on (on the CPU too slow to tell anything)
        Row(CEILING, small, args=synth + wide, image=side, cuda_only=True, headline=True,
            need_s=75),
        Row(GRAPH, small, args=synth + wide + graph, image=side, cuda_only=True, headline=True,
            need_s=75),
        Row(FSDP, small, "fsdp_train.py", synth + wide + full, image=side, cuda_only=True,
            headline=True, need_s=80),
        Row(CEILING, huge, args=synth, cuda_only=True, need_s=25),
        Row(FSDP, small, "fsdp_train.py", synth + full, need_s=20),
        Row("dp (one GPU), synthetic on device", small, "dp_train.py", synth + one_gpu,
            need_s=20),
        Row("ddp, cache", small, args=["{data}", "{cache}"], needs_data=True, need_s=20),
        Row("ddp, cache held on device", big, args=["{data}", "{cache}", "--data-on-device"],
            needs_data=True, need_s=20),
        Row("ddp, JPEG folder", small, args=["{data}"], needs_data=True, need_s=25),
    ]
    rungs = [("dp", "dp_train.py", one_gpu), ("ddp", "ddp_train.py", []),
             ("ddp --zero1", "ddp_train.py", ["--zero1"]),
             ("fsdp grad-op", "fsdp_train.py", ["--sharding", "grad-op"]),
             ("fsdp full", "fsdp_train.py", ["--sharding", "full"]),
             ("fsdp full --offload", "fsdp_train.py", ["--offload"])]
    # one GPU as rank 0 of 8 (--simulate-world-size): what each ZeRO rung leaves on a GPU of 8.
    # The CPU smoke run holds them at 64 px only: a CPU's figures are the states, which are the
    # same at every image size, so a second size would only repeat the first.
    at_8 = [Row(f"memory at 8 GPUs: {label}", small, script, synth + extra + (
                [] if px == 64 else ["--image-size", str(px)]) + ["--simulate-world-size", "8"],
                image=px, kind="held", need_s=20 if px == 64 else 30)
            for px in ((64, side) if gpu else (64,)) for label, script, extra in rungs[1:]]
    untimed = [
        Row("equivalence tests, 2 ranks sharing a GPU", 0, kind="shared tests", cuda_only=True,
            need_s=240),
        Row("equivalence tests on CUDA", 0, kind="tests", cuda_only=True, need_s=150),
        Row("kill and resume: fsdp_train.py, 2 ranks sharing the GPU", 16, "fsdp_train.py",
            kind="kill-resume", need_s=60),
        # the case the shared-GPU equivalence tests add to a plain shared-GPU run (the full
        # state dict gathered over gloo from CUDA shards), alone: it ended in SIGSEGV in them
        Row("fsdp --save-model, 2 ranks sharing the GPU", 16, "fsdp_train.py",
            kind="save-model", cuda_only=True, need_s=40),
        Row("launchers: local.sh, its memory logs, analyze_memory.py --plot", small,
            kind="launcher", need_s=60),
        # offload's gradient shards on the CPU under fp16's GradScaler: gloo beside NCCL (what
        # the row shows is that it trains; alone on an H200, 17 s an epoch of 30 steps, with
        # a first step of 12 s)
        Row("fsdp --offload fp16, synthetic on device", small, "fsdp_train.py",
            synth + ["--offload", "--amp", "fp16"], cuda_only=True, timed=False, need_s=50),
        # the launches per step and where a step's time goes, in rows of their own: the
        # profiler's trace slows the steps around it, so no timed row runs under it
        Row(f"profile: {CEILING}", small, args=synth + profile, kind="profile", need_s=20),
        Row(f"profile: {GRAPH}", small, args=synth + graph + profile, kind="profile",
            cuda_only=True, need_s=25),
        # where FSDP's step loses to DDP's on one GPU (the [PROFILE] breakdown)
        Row(f"profile: {FSDP}", small, "fsdp_train.py", synth + wide + full + profile,
            image=side, kind="profile", cuda_only=True, need_s=40),
    ] + at_8
    memory = [Row(f"memory: {label}", small, script, ["{data}", "{cache}"] + extra
                  + ([] if px == 64 else ["--image-size", str(px)]), image=px, needs_data=True,
                  timed=False, need_s=25 if px == 64 else 40)
              for px in (64, side) for label, script, extra in rungs]
    # eager, --cuda-graph and each --compile mode where they are compared, one after another
    # (a compilation beside a timed row would slow it, and max-autotune times kernels itself):
    # 224 px first, the size the target judges, so that a run its --minutes cut short has
    # those, and --continue the rest
    sizes = [(small, side, wide), (big, 64, [])]
    compiled = [row for batch, px, extra in sizes for row in [
        Row(label, batch, args=synth + extra + more, image=px, cuda_only=True, headline=True,
            need_s=35 if px == 64 else 75) for label, more in ((CEILING, []), (GRAPH, graph))] + [
        Row(compiled_label(mode), batch, args=synth + extra + ["--compile", mode], image=px,
            cuda_only=True, headline=True, need_s=COMPILE_GUESS[mode])
        for mode in flags.COMPILE_MODES]]
    # the plain step without the toolkit, the yardstick of the two rows before it: in the
    # groups that judge the targets (--rows speed, which must fit its 8 minutes, leaves it out)
    raw = [Row(RAW_EAGER, small, "bench/raw_step.py", ["--mode", "eager"], kind="raw",
               headline=True, need_s=15),
           Row(RAW_GRAPH, small, "bench/raw_step.py", ["--mode", "graph"], kind="raw",
               cuda_only=True, headline=True, need_s=15)]
    # --rows targets: the headline rows, those gpu_report.targets() reads, and the raw eager
    # step beside them, for figures no other row disturbs
    headline = [row for row in timed if row.headline]
    rows = {"speed": timed + untimed, "targets": headline[:2] + raw + headline[2:],
            "memory": memory, "compile": compiled,
            "all": timed[:2] + raw + timed[2:] + compiled + untimed + memory}[which]
    once = {}  # "all": the eager and --cuda-graph rows of both groups run once
    for row in rows:
        once.setdefault(row.key, row)
    return list(once.values())


def compiled_label(mode: str) -> str:
    return f"ddp --compile {mode}, synthetic on device"


def row_steps(row: Row, steps: int) -> int:
    """Steps an epoch of ``row``: --steps for a headline figure, at most WINDOW for the rest."""
    return steps if row.headline else min(steps, WINDOW)


def synthetic_size(row: Row, steps: int) -> int:
    """Training samples a synthetic row needs: one epoch's batches; rank 0 of N
    (--simulate-world-size) reads 1/N of them and trains simulate.STEPS steps, so N times
    those."""
    if "--simulate-world-size" in row.args:
        world = int(row.args[row.args.index("--simulate-world-size") + 1])
        return row.batch * simulate.STEPS * world
    return row.batch * max(steps, 2)


def row_args(row: Row, model: str, steps: int, paths: dict) -> list:
    """The training script's arguments: two epochs of ``steps`` steps (a profiled row: one,
    its trace window is in the first); synthetic data sized by synthetic_size."""
    args = []
    for a in row.args:
        if a == "{data}":
            args += ["--data-dir", paths["data"]]
        elif a == "{cache}":
            args += ["--data-cache", paths["cache"]]
        elif a == "{profile}":  # a folder of each row's own: rows run side by side
            args.append(str(Path(paths["profile"]) / re.sub(r"\W+", "-", row.key)))
        else:
            args.append(a)
    if not row.needs_data:
        args += ["--synthetic-size", str(synthetic_size(row, steps))]
    epochs = "1" if row.kind == "profile" else "2"
    return ["--model", model, "--epochs", epochs, "--max-steps-per-epoch", str(steps),
            "--batch-size", str(row.batch), "--log-every", "0"] + args


def raw_args(row: Row, model: str, steps: int, gpu: bool) -> list:
    """bench/raw_step.py's arguments: ``steps`` timed steps of the row's mode and size, after
    its 10 warm-up steps on a GPU (cuDNN's autotuning); on the CPU (the smoke run) one."""
    return [*row.args, "--model", model, "--image-size", str(row.image), "--batch-size",
            str(row.batch), "--steps", str(steps)] + ([] if gpu else ["--warmup", "1"])
