"""Which device a run trains on, decided once at start by ``use_gpu(args)``: the GPU when this
torch can run on it, the CPU when the run asks for it (``--device cpu``) or was given no GPU,
and otherwise one sentence that names the fix (a UsageError: exit code 2).

Two mismatches between a torch build and a GPU node are common on clusters, and without this
check neither says what is wrong:

- the build has no kernels for the GPU. pip's torch 2.14 is built for CUDA 13, whose kernels
  start at compute capability 7.5; on a V100 (7.0) ``torch.cuda.is_available()`` is still True,
  and every kernel then fails with "no kernel image is available for execution on the device";
- the NVIDIA driver is older than the build's CUDA. ``torch.cuda.is_available()`` is then False,
  and a run on a GPU node would train on the CPU, about 100x slower, after a one-line note.

Importing this module has no side effects; of this project it imports faults.py only.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import warnings

import torch

from training.faults import UsageError

#: PyTorch's wheel index for one CUDA build, e.g. INDEX.format("cu126").
INDEX = "https://download.pytorch.org/whl/{}"

#: The CUDA builds to recommend. cu126 is the newest build that still has kernels for GPUs
#: older than compute capability 7.5 (V100, P100) and runs on every CUDA 12 driver; cu128 is
#: the first with kernels for Blackwell (10.0, 12.0); cu130 is pip's default build.
OLD_GPUS, BLACKWELL_ON_CUDA12, NEWEST = "cu126", "cu128", "cu130"


#: The oldest torch and torchvision this project runs on, as requirements.txt says. Before
#: 2.9, gloo's reduce-scatter returns the sum where FSDP2 asks for the average, so FSDP on the
#: CPU trains with gradients world-size times too large, silently (the equivalence tests fail
#: on 2.7 and 2.8); on 2.6 every FSDP run fails at its first forward ('Stream' object has no
#: attribute 'record_event'); on 2.5 fsdp_train.py cannot import MixedPrecisionPolicy. .ci/run
#: tests this pair.
MIN_TORCH, MIN_TORCHVISION = (2, 9), (0, 24)


def torchvision_version() -> str:
    """The installed torchvision's version, from its package metadata: importing torchvision
    added about 0.1 s to every run's start (0.6 s on its own), and only ResNet and the image
    folders need it."""
    try:
        return importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:  # on the path without its metadata
        try:
            import torchvision
        except ImportError:
            return "(not installed)"
        return torchvision.__version__


def check_versions(torch_version: str, torchvision_version: str) -> None:
    """Stop with one sentence when torch or torchvision is older than the floor."""
    have = (_version(torch_version), _version(torchvision_version))
    if have[0] and have[1] and have[0] >= MIN_TORCH and have[1] >= MIN_TORCHVISION:
        return
    want = (f"torch {MIN_TORCH[0]}.{MIN_TORCH[1]} and torchvision "
            f"{MIN_TORCHVISION[0]}.{MIN_TORCHVISION[1]}")
    raise UsageError(f"this torch {torch_version} with torchvision {torchvision_version} is "
                     f"older than the {want} this project needs (FSDP2 fails on older ones): "
                     f"pip install -r requirements.txt, or pip install 'torch>={MIN_TORCH[0]}."
                     f"{MIN_TORCH[1]}' 'torchvision>={MIN_TORCHVISION[0]}."
                     f"{MIN_TORCHVISION[1]}' (with --index-url for a CUDA build, see the "
                     f"README); a cluster's 'module load pytorch' may be too old")


def install_command(build: str) -> str:
    """The pip command that installs torch and torchvision of one CUDA build (e.g. cu126)."""
    return f"pip install torch torchvision --index-url {INDEX.format(build)}"


def _built_for(arch: str) -> tuple | None:
    """The compute capability of one arch-list entry: 'sm_86' is (8, 6), 'compute_120' is
    (12, 0), 'sm_90a' is (9, 0); None for a name of another kind."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", arch)
    return (int(m.group(1)) // 10, int(m.group(1)) % 10) if m else None


def has_kernels_for(capability: tuple, arch_list: list) -> bool:
    """Can a torch built for ``arch_list`` (``torch.cuda.get_arch_list()``) run on a GPU of
    this compute capability?

    An entry 'sm_86' is machine code for compute capability 8.6. It runs on GPUs of the same
    major version and the same or a higher minor one (8.6, 8.9), never on an older GPU nor on
    the next major version. An 'sm_90a' entry (architecture-specific) runs on 9.0 only. An
    entry 'compute_120' is PTX, which the driver compiles for 12.0 and any newer GPU. A list
    this function cannot read (empty, or ROCm's 'gfx90a' names) is taken as able to run."""
    readable = False
    for arch in arch_list:
        built = _built_for(arch)
        if built is None:
            continue
        readable = True
        if arch.endswith("a"):  # architecture-specific code: this exact GPU generation only
            fits = built == capability
        elif arch.startswith("sm_") or arch.endswith("f"):  # the same major version, minor >= built
            fits = built[0] == capability[0] and built[1] <= capability[1]
        else:  # PTX: compiled by the driver for this GPU or any newer one
            fits = built <= capability
        if fits:
            return True
    return not readable


def gpus_given() -> str:
    """What says this job was given GPUs, as a phrase for a sentence ('' when nothing does).

    CUDA_VISIBLE_DEVICES decides when it is set, as in launch/node.sh: empty or -1 hides every
    GPU on purpose. Otherwise Slurm's GPU variables, and at last the GPUs ``nvidia-smi -L``
    lists (only where nvidia-smi exists; a hung driver gets 10 s)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        visible = os.environ["CUDA_VISIBLE_DEVICES"].strip()
        return "" if visible in ("", "-1") else f"CUDA_VISIBLE_DEVICES={visible}"
    # a count, then two lists of GPU indices ("0,1")
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = os.environ.get(name, "").strip()
        if value and not (name == "SLURM_GPUS_ON_NODE" and value == "0"):
            return f"{name}={value}"
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    count = sum(line.startswith("GPU ") for line in listed.splitlines())
    return f"nvidia-smi -L lists {count} GPU(s)" if count else ""


def driver_cuda(init_warning: str = "") -> tuple | None:
    """The newest CUDA version the NVIDIA driver supports, as (major, minor): from the header of
    ``nvidia-smi`` ("CUDA Version: 12.4"), else from torch's CUDA initialization warning
    ("found version 12040"); None when neither says."""
    if shutil.which("nvidia-smi") is not None:
        try:
            header = subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                    timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            header = ""
        m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header)
        if m:
            return int(m.group(1)), int(m.group(2))
    m = re.search(r"found version (\d+)", init_warning)  # CUDA's own number: 12040 is 12.4
    if m:
        number = int(m.group(1))
        return number // 1000, number % 1000 // 10
    return None


def _version(text: str | None) -> tuple | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_kernels() -> None:
    """Stop with one sentence when this torch has no kernels for one of the visible GPUs."""
    arch_list = torch.cuda.get_arch_list()
    for index in range(torch.cuda.device_count()):
        capability = tuple(torch.cuda.get_device_capability(index))
        if has_kernels_for(capability, arch_list):
            continue
        lowest = min((_built_for(a) for a in arch_list if a.startswith("sm_") and
                      _built_for(a)), default=None)
        if lowest is not None and capability < lowest:  # an old GPU, e.g. a V100 on CUDA 13
            fix = (f"install the torch built for CUDA 12.6, the newest build with kernels for "
                   f"GPUs before compute capability 7.5: {install_command(OLD_GPUS)}")
        else:  # a GPU newer than the build
            fix = f"install a torch built for a newer CUDA: {install_command(NEWEST)}"
        raise UsageError(
            f"the GPU {torch.cuda.get_device_name(index)} has compute capability "
            f"{capability[0]}.{capability[1]}, but this torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) has no kernels for it (it was built for "
            f"{' '.join(arch_list)}): {fix}")


def why_no_gpu(init_warning: str) -> str:
    """Why torch sees no GPU, and the fix, as the end of one sentence."""
    if torch.version.cuda is None and torch.version.hip is None:
        return (f"this torch {torch.__version__} is a CPU-only build; install a CUDA build, "
                f"e.g. {install_command(OLD_GPUS)} (any GPU up to Hopper, any CUDA 12 "
                f"driver)")
    built, driver = _version(torch.version.cuda), driver_cuda(init_warning)
    if built and driver and driver < built:
        said = (f"this torch {torch.__version__} is built for CUDA {built[0]}.{built[1]}, but "
                f"the NVIDIA driver supports CUDA {driver[0]}.{driver[1]} at most")
        if driver[0] < 12:
            return f"{said}; ask for a newer driver (CUDA 12.6 or later)"
        build = BLACKWELL_ON_CUDA12 if driver >= (12, 8) else OLD_GPUS
        return (f"{said}; install a torch built for a CUDA this driver runs, "
                f"{install_command(build)}")
    detail = f" ({init_warning.strip().splitlines()[0]})" if init_warning.strip() else ""
    return (f"torch.cuda.is_available() is False{detail}; check that nvidia-smi works on this "
            f"node and that this torch ({torch.__version__}, CUDA {torch.version.cuda}) fits "
            f"its driver")


def use_gpu(args) -> bool:
    """Whether this run trains on the GPU(s) torch sees (--device: auto, cuda or cpu).

    --device cpu: never, whatever the node has. Otherwise, when torch sees a GPU, this torch
    must have kernels for it. When torch sees none, the run trains on the CPU only if nothing
    says it was given GPUs (and --device is not cuda): a GPU job that cannot use its GPUs stops
    with one sentence that says why, instead of training many times slower on the CPU."""
    if args.device == "cpu":
        return False
    # torch says once per process why CUDA failed to initialise (as a warning): keep its text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    init_warning = " ".join(str(w.message) for w in caught if "CUDA" in str(w.message))
    if available:
        check_kernels()
        return True
    given = gpus_given()
    if given:
        raise UsageError(f"this job was given GPUs ({given}) but torch cannot use them: "
                         f"{why_no_gpu(init_warning)}; or add --device cpu to train on the CPU "
                         f"on purpose")
    if args.device == "cuda":
        raise UsageError(f"--device cuda, but torch sees no GPU: {why_no_gpu(init_warning)}; "
                         f"or use --device auto or cpu")
    return False


def cpu_flags() -> set:
    """The instruction-set flags of this CPU (Linux's /proc/cpuinfo; elsewhere none known)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def cpu_amp_note(amp: str, flags: set) -> str:
    """What --amp fp16 or bf16 does to a CPU run, for this CPU. Measured on a 2-core AMD EPYC
    VM with AVX512-BF16 and AMX, the CIFAR-10 CNN at 2 ranks: fp16 about 16x slower than
    fp32, bf16 1.5x faster (1,118-1,190 against 779-790 img/s)."""
    if amp == "fp16":
        return ("warning: --amp fp16 on a CPU trains many times slower than --amp off (16x "
                "measured: CPUs have few fast fp16 kernels); use --amp off, or --amp bf16 on a "
                "CPU with avx512_bf16 or amx_bf16")
    fast = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if fast:
        return (f"note: --amp bf16 on a CPU with {' and '.join(fast)}: its bf16 kernels can be "
                f"faster than fp32 (1.5x measured for the CIFAR-10 CNN); the loss differs "
                f"slightly from --amp off")
    return ("warning: --amp bf16 on a CPU without bf16 instructions (avx512_bf16, amx_bf16): "
            "its bf16 kernels are emulated and can be several times slower than --amp off; "
            "compare both, or use --amp off here")
