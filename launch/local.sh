#!/bin/bash
# The Slurm job's run directory, memory loggers and summary, on a machine WITHOUT Slurm: one
# torchrun (--standalone) on this machine through the same launch/job.sh and launch/node.sh.
#
#   bash launch/local.sh                                   # NPROC processes (default: GPUs, else 1)
#   bash launch/local.sh --nproc-per-node 2 -- --epochs 1 --model cnn
#   NPROC=2 STRATEGY=ddp bash launch/local.sh --epochs 1   # the same, NPROC from the environment
#   STRATEGY=dp bash launch/local.sh --epochs 1            # one python process (dp_train.py)
#
# Options before "--" belong to this script (--nproc-per-node N, -h); everything else goes to
# the training script. Variables: NPROC (or NPROC_PER_NODE), JOB_NAME (local), RUNS_DIR
# ($PWD/runs), plus those of launch/job.sh (STRATEGY, PYTHON, DATA_DIR, LOG_INTERVAL, SITE_SH);
# LOG_INTERVAL defaults to 1 here (job.sh's 5 s could miss a short local run's training).
# Run directory: $RUNS_DIR/<JOB_NAME>-<date>-<time>-<pid>/ laid out as under Slurm, with the
# machine's short host name as the node name.
set -euo pipefail

usage() { sed -n '2,16s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

nproc_opt=${NPROC:-${NPROC_PER_NODE:-}}
while [ $# -gt 0 ]; do
  case $1 in
    --nproc-per-node | --nproc_per_node)
      [ $# -ge 2 ] || { echo "error: $1 needs a number" >&2; exit 2; }
      nproc_opt=$2
      shift 2
      ;;
    --nproc-per-node=* | --nproc_per_node=*) nproc_opt=${1#*=}; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;  # the first unknown argument starts the training arguments
  esac
done
for arg in "$@"; do  # the training's parser would name the training script, not the fix
  case $arg in
    --nproc-per-node | --nproc_per_node | --nproc-per-node=* | --nproc_per_node=*)
      echo "error: $arg comes after the training arguments: put it before them" \
        "(bash launch/local.sh --nproc-per-node N -- TRAINING ARGS), or set NPROC=N" >&2
      exit 2
      ;;
  esac
done
if [ -n "$nproc_opt" ]; then
  if ! [[ $nproc_opt =~ ^[1-9][0-9]*$ ]]; then
    echo "error: --nproc-per-node/NPROC must be a positive integer, got '$nproc_opt'" >&2
    exit 2
  fi
  export NPROC_PER_NODE=$nproc_opt
fi

# A memory sample every second: a local run is short (a demo, a study on a workstation), and
# at job.sh's 5 s the CPU log of a 10 s training held two samples, both before it began.
: "${LOG_INTERVAL:=1}"
export LOG_INTERVAL
# Not under Slurm, even when started from inside an allocation: job.sh picks its local path.
unset SLURM_JOB_ID
exec bash "$(dirname "${BASH_SOURCE[0]}")/job.sh" "$@"
