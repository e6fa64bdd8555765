"""torchrun for launch/node.sh, acting on its first stop signal only.

    python launch/torchrun_once.py --standalone --nproc-per-node 2 ddp_train.py --epochs 1

The arguments are torchrun's (python -m torch.distributed.run --help). Slurm ends a job
(scancel, scontrol requeue, preemption, the time limit) with a SIGTERM to every process of it,
torchrun too; node.sh, and under Slurm job.sh, pass the stop on once more, because either may
be the only process that got it. torchrun's own handler raises on every stop signal, so the
second one cuts its shutdown short: its "Received 15 death signal" line ends in "--- Logging
error ---" in train.log, or it stops waiting for its workers and signals them again. Here a
repeat is ignored: torchrun signals its workers once, waits for them (their checkpoint sentence
and [STOP] line) and ends, with 128 + the signal's number (130 after a Ctrl-C, 143 after a
SIGTERM) and without the traceback of torch's SignalException.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for training/
from torch.distributed import run  # noqa: E402

from training import torch_private  # noqa: E402


def main(argv=None) -> None:
    try:
        torch_private.torchrun_stops_once()
    except torch_private.TorchInternalMoved as e:
        # Not a reason to refuse the job: torchrun still stops, only less cleanly on a repeat.
        print(f"warning: {e}; torchrun runs as it is, and a second stop signal may cut its "
              f"shutdown short", file=sys.stderr)
    try:
        run.main(argv)
    except Exception as e:
        # A stop signal (Ctrl-C; Slurm's SIGTERM at scancel, scontrol requeue, preemption):
        # torchrun's handler raises its SignalException once the workers have ended, each with
        # its own sentence ("SIGTERM: checkpoint saved ..."); its traceback below them, 20
        # lines in every requeued job's output, said nothing more. Only that handler raises
        # an exception with a sigval, for each signal it handles.
        sigval = getattr(e, "sigval", None)
        if sigval is None:
            raise
        sys.exit(128 + sigval)


if __name__ == "__main__":
    main()
