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

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for training/
from torch.distributed import run  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402

from training import torch_private  # noqa: E402


def main(argv=None) -> None:
    try:
        torch_private.torchrun_stops_once()
    except torch_private.TorchInternalMoved as e:
        # Not a reason to refuse the job: torchrun still stops, only less cleanly on a repeat.
        print(f"warning: {e}; torchrun runs as it is, and a second stop signal may cut its "
              f"shutdown short", file=sys.stderr)
    # `scancel --signal=USR2 JOBID` asks every training process for its stacks: torchrun has
    # no handler, and at the default action it would end (node.sh ignores it too)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        run.main(argv)
    except ChildFailedError as e:
        # A worker that failed has said why in its own lines (a refusal's one sentence, or its
        # traceback); torchrun's traceback and failure table after it, 40 lines per node, hid
        # that sentence. One line instead, with the first failure's exit code as torchrun
        # reports it ("exitcode: -6" for NCCL's abort, which launch/job.sh reads), exit 1.
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f" ({failure.signal_name()})" if code is not None and code < 0 else ""
        print(f"torchrun: {len(e.failures)} worker(s) failed; the first: rank {rank} (pid "
              f"{failure.pid}), exitcode: {code}{how}; its own lines above say why",
              file=sys.stderr, flush=True)
        sys.exit(1)
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
