#!/bin/bash
# The one job skeleton behind launch/baseline.slurm, multi_gpu.slurm, multi_node.slurm (under
# Slurm) and launch/local.sh (without Slurm). Every count comes from Slurm; nothing is repeated.
#
#   bash launch/job.sh [TRAINING ARGS...]     (the .slurm files and local.sh call it for you)
#
# What it does: source launch/site.sh if present, resolve ${STRATEGY}_train.py and parse the
# training arguments with its parser (a bad flag: one sentence, exit 2), make one run
# directory, then start launch/node.sh once per node (srun --ntasks-per-node=1; directly without
# Slurm), which runs the memory loggers and one torchrun (ddp, fsdp) or one python (dp) there.
# The training output is tee'd into train.log; afterwards analyze_memory.py summarises the
# memory logs. The job's exit code is the training's, whatever the analysis does.
#
# Variables (all optional; defaults run on a generic cluster):
#   STRATEGY      ddp | fsdp | dp (ddp): runs $REPO_DIR/${STRATEGY}_train.py
#   TRAIN_SCRIPT  run this script instead of ${STRATEGY}_train.py
#   REPO_DIR      repository root (the .slurm files find it; see there)
#   PYTHON        interpreter command, split on spaces (python), e.g.
#                 "apptainer exec --nv img.sif python"; torchrun = "$PYTHON launch/torchrun_once.py"
#   DATA_DIR      dataset root, read by the training script (unset: synthetic data)
#   RUNS_DIR      parent of the run directories ($SLURM_SUBMIT_DIR/runs, locally $PWD/runs)
#   LOG_INTERVAL  seconds between memory samples (5; launch/local.sh: 1)
#   NPROC_PER_NODE  processes per node (default: GPUs on the node, 1 without GPUs)
#   SITE_SH       site file to source (launch/site.sh; empty = none)
#   SRUN_EXTRA_ARGS extra srun options, split on spaces (e.g. --container-image=...)
#   CHECKPOINT_DIR  passed as --checkpoint-dir ($RUN_DIR/checkpoints; empty = no checkpoints;
#                 ignored when the training arguments name --checkpoint-dir themselves)
#   CHECK_ONLY    1 (or yes) = run only the training script's --check (preflight + all-reduce test)
#   REQUEUE       1 (default; 0 or no: not) = requeue the job after the training checkpointed on a
#                 stop signal
#   RUN_DIR       continue in this existing run directory (default: a new one, see below)
#   NCCL_DEBUG (WARN), NCCL_SOCKET_IFNAME (unset: NCCL chooses; unless GLOO_SOCKET_IFNAME is
#   set, node.sh gives gloo the interface of its node that NCCL's setting names: the stop vote
#   runs on a gloo group), OMP_NUM_THREADS (CPUs / processes per node: node.sh).
#   TORCH_NCCL_ASYNC_ERROR_HANDLING is left to PyTorch (its default, 3, tears the process down
#   without mode 1's hanging abort; this script then says that a collective failed).
#
# Run directory: ${RUNS_DIR}/<job-name>-<job-id>/ with train.log, job.env, gpu_memory/<node>.csv,
# cpu_memory/<node>.txt, checkpoints/, memory_summary.txt and memory_summary.json. A requeued job
# keeps its job id, so it comes back to the same directory (and RUN_DIR=... continues any run):
# train.log is appended to, and each later attempt logs memory to <node>.restart<N>.csv/.txt
# beside the first attempt's logs.
#
# Stop signals (time limit, preemption): the .slurm files ask Slurm for SIGUSR1 120 s before the
# time limit (#SBATCH --signal=B:USR1@120). This script traps USR1 and TERM and forwards them to
# the training processes on every node (scancel --signal, which reaches the job steps but not this
# batch shell); the training checkpoints at its next step and exits 75, and this script then runs
# `scontrol requeue`. The requeued job resumes from $RUN_DIR/checkpoints by itself (--resume auto).
# A job that was cancelled (scancel) is not requeued; its checkpoint stays for a later RUN_DIR=...
# The script is one { } block, which bash reads whole before it runs any of it: bash reads a
# script as it runs it, so an edit of this file while a job runs (hours) would otherwise
# become the rest of that job.
{
set -euo pipefail
# A stop signal before the training runs (while site.sh or the flag check below take their
# time) would kill bash without a word. It is kept instead: a TERM (scancel, preemption) ends
# the job before the training starts, Slurm's time-limit warning (USR1) is passed on once it runs.
early_signal=${EARLY_SIGNAL:-} early_at=${EARLY_AT:-}  # one the .slurm file kept
unset EARLY_SIGNAL EARLY_AT
trap 'early_signal=${early_signal:-USR1} early_at=${early_at:-$(date +%H:%M:%S)}' USR1
trap 'early_signal=TERM early_at=$(date +%H:%M:%S)' TERM

# A CDPATH from the user's dotfiles makes `cd` print the folder, into the paths taken below
unset CDPATH
LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=/dev/null  # launch/lib.sh, checked on its own
source "$LAUNCH_DIR/lib.sh"
: "${REPO_DIR:=$(dirname "$LAUNCH_DIR")}"
export REPO_DIR

# ---- site specifics: the one optional place (see launch/site.sh.example) ----------------------
SITE_SH=${SITE_SH-$LAUNCH_DIR/site.sh}
if [ -f "$SITE_SH" ]; then  # false for SITE_SH= (none)
  echo "site settings: $SITE_SH"
  set +u  # module and conda scripts read unset variables
  # A failing line (a module that is not there, conda without its conda.sh) ended the job
  # with bash's own line at most: name the line and the way out. (Without set -E: the trap
  # stays out of the functions and $(...) of module and conda scripts, where a failure is
  # often expected and handled.)
  # (Only while errexit is on: a site file that turned it off with set +e goes on, as before.)
  # sbatch reads SBATCH_* when the job is submitted: one the site file sets in the job is
  # too late (it is sourced again here; a value already in the submit shell's is no change)
  declare -A sbatch_before=()
  for v in $(compgen -v SBATCH_ || true); do sbatch_before[$v]=${!v}; done
  site_rc=0 site_line=0
  trap 'site_rc=$? site_line=$LINENO; if [[ $- == *e* ]]; then
    echo "error: site settings $SITE_SH, line $site_line: \"$BASH_COMMAND\" failed (exit" \
      "$site_rc): fix that line (conda: source its etc/profile.d/conda.sh first), or run" \
      "with SITE_SH= to skip the file" >&2; exit 2; fi' ERR
  # shellcheck source=/dev/null
  source "$SITE_SH"
  trap - ERR
  set -eu  # a set +e of the site file's ends with it: this script stops at its own errors
  late=()
  for v in $(compgen -v SBATCH_ || true); do
    if [ "${sbatch_before[$v]+set}" != set ] || [ "${sbatch_before[$v]}" != "${!v}" ]; then
      late+=("$v=${!v}")
    fi
  done
  if [ -n "${SLURM_JOB_ID:-}" ] && [ "${#late[@]}" -gt 0 ]; then
    echo "warning: $SITE_SH sets ${late[*]} inside the job, where it changes nothing: sbatch" \
      "reads SBATCH_* when you submit (this job got partition ${SLURM_JOB_PARTITION:-?});" \
      "export it there and source the file in the shell you submit from: source $SITE_SH &&" \
      "sbatch ..." >&2
  fi
fi

# ---- defaults, each overridable from the environment -----------------------------------------
: "${STRATEGY:=ddp}"
: "${PYTHON:=python}"
: "${LOG_INTERVAL:=5}"
: "${NCCL_DEBUG:=WARN}"
: "${PYTHONFAULTHANDLER:=1}"
export STRATEGY PYTHON LOG_INTERVAL NCCL_DEBUG PYTHONFAULTHANDLER
# Exported only when set (site.sh may set them without export): NCCL's interface (e.g. ib0;
# unset = NCCL chooses), and gloo's. Without gloo's, node.sh resolves NCCL's setting (which may
# be a prefix or an exclusion, gloo's must be a name) to an interface of each node.
if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then export NCCL_SOCKET_IFNAME; fi
if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then export GLOO_SOCKET_IFNAME; fi
if [ -n "${DATA_DIR:-}" ]; then export DATA_DIR; fi
if ! [[ $LOG_INTERVAL =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] || \
    [[ $LOG_INTERVAL =~ ^[0.]+$ ]]; then  # psrecord took 0 for a busy loop, abc for nothing
  echo "error: LOG_INTERVAL=$LOG_INTERVAL: give the seconds between memory samples, a" \
    "number above 0 (default 5)" >&2
  exit 2
fi
check_only=$(on_off CHECK_ONLY 0) || exit 2
requeue=$(on_off REQUEUE 1) || exit 2
if [ -n "${NPROC_PER_NODE:-}" ] && ! [[ $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC_PER_NODE=$NPROC_PER_NODE: give the processes per node, a whole number" \
    "of 1 or more, or unset it for one per GPU" >&2
  exit 2
fi
read -ra python_cmd <<<"$PYTHON"
# (Not with SRUN_EXTRA_ARGS, e.g. a container image: PYTHON may exist only inside the step.)
if [ -z "${SRUN_EXTRA_ARGS:-}" ] && ! command -v "${python_cmd[0]:-}" >/dev/null; then
  echo "error: PYTHON=$PYTHON is not a command here: set PYTHON to your environment's" \
    "Python (e.g. PYTHON=\$VIRTUAL_ENV/bin/python), or unset it for python on PATH" >&2
  exit 2
fi

case $STRATEGY in
  ddp | fsdp) mode=torchrun ;;
  dp) mode=python ;;  # nn.DataParallel: one process drives every GPU of one node
  *) echo "error: STRATEGY=$STRATEGY is not one of ddp, fsdp, dp" >&2; exit 2 ;;
esac
own_script=${TRAIN_SCRIPT:+1}  # a TRAIN_SCRIPT of the user's own is not parse-checked below
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$REPO_DIR/${STRATEGY}_train.py}
if [ ! -f "$TRAIN_SCRIPT" ]; then
  echo "error: $TRAIN_SCRIPT not found: STRATEGY=$STRATEGY needs ${STRATEGY}_train.py in" \
    "REPO_DIR=$REPO_DIR (pick another STRATEGY or set REPO_DIR)" >&2
  exit 2
fi

for arg in "$@"; do  # the training script's help, not a run directory and a torchrun for it
  case $arg in -h | --help) exec "${python_cmd[@]}" "$TRAIN_SCRIPT" --help ;; esac
done

# The training arguments, checked by the repository script's own parser and value checks
# (launch/check_args.py, as run_benchmarks.py does for a study) before any run directory, logger
# or torchrun: a typo or an impossible value gets one sentence, not a failed run and torchrun's
# traceback. Not again for a
# requeued run (its arguments were accepted), but for one continued with RUN_DIR (its arguments
# are new). Exit 3: this Python lacks torch (unless a container's, SRUN_EXTRA_ARGS, runs the
# training); any other exit but 2 means not checked: then the training itself will say why.
restarts=${SLURM_RESTART_COUNT:-0}
if [ -z "$own_script" ] && [ "$restarts" = 0 ]; then
  check_rc=0
  refused=$(timeout 300 "${python_cmd[@]}" "$LAUNCH_DIR/check_args.py" "$TRAIN_SCRIPT" "$@" \
    2>&1 >/dev/null) || check_rc=$?
  refused=${refused##*$'\n'}  # the refusal (argparse's or check_flags') is its last line
  if [ "$check_rc" = 2 ] && [[ $refused == *": error: "* ]]; then
    fix="python $(basename "$TRAIN_SCRIPT") --help lists its flags"
    case " ${refused##*unrecognized arguments: }" in  # sbatch's, after the .slurm file
      *" --nodes"* | *" --gpus-per-node"* | *" --gres"* | *" --time"* | *" --partition"* | \
        *" --account"* | *" --ntasks"* | *" --cpus-per-task"* | *" --mem"* | *" --qos"* | \
        *" --constraint"* | *" --exclusive"* | *" --job-name"* | *" --output"*)
        fix="sbatch's own options go before the .slurm file:"
        fix+=" sbatch --nodes=2 launch/multi_node.slurm [TRAINING ARGS]" ;;
    esac
    echo "error: the training arguments are refused: $refused ($fix)" >&2
    exit 2
  fi
  if [ "$check_rc" = 3 ] && [ -z "${SRUN_EXTRA_ARGS:-}" ]; then
    echo "$refused: activate the environment that has it (pip install -r requirements.txt)," \
      "or set PYTHON to its python" >&2
    exit 2
  fi
fi

# ---- layout: from Slurm, or this one machine --------------------------------------------------
# Whether TCP port $1 is in use on this host, as torchrun's store would bind it
PORT_IN_USE='
import errno, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError as e:
    sys.exit(e.errno != errno.EADDRINUSE)
sys.exit(1)'
if [ -n "${SLURM_JOB_ID:-}" ]; then
  job_id=$SLURM_JOB_ID
  job_name=${SLURM_JOB_NAME:-job}
  submit_dir=${SLURM_SUBMIT_DIR:-$PWD}
  hostnames=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
  mapfile -t nodes <<<"$hostnames"
  nnodes=${SLURM_NNODES:-${#nodes[@]}}
  export MASTER_ADDR=${nodes[0]}
  export PEER_ADDR=${nodes[1]:-}  # the master node's way to the others (gloo's interface)
  export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))  # differs for two jobs sharing a node
  # A port another process holds on the master node (this one) left the rendezvous waiting a
  # minute in silence, then every node's traceback: take the first free one of 49 others, and
  # say so. They lie below the derived ports (10000-19999) and step 1009 apart, so the next
  # job's own port or list is not this one's (training/allocation.py job_ports: the same
  # rule). python3 exits 0 for a port in use; 1 for a free one, or where it cannot tell.
  if [ "${SLURMD_NODENAME:-}" = "$MASTER_ADDR" ]; then
    chosen=""
    for k in $(seq -1 48); do
      port=$MASTER_PORT
      if [ "$k" -ge 0 ]; then port=$((10000 + (SLURM_JOB_ID + k * 1009) % 10000)); fi
      if ! python3 -c "$PORT_IN_USE" "$port" 2>/dev/null; then chosen=$port; break; fi
    done
    if [ -z "$chosen" ]; then
      echo "note: port $MASTER_PORT on $MASTER_ADDR and the 49 others this job may take are" \
        "all in use: the rendezvous tries $MASTER_PORT"
    elif [ "$chosen" != "$MASTER_PORT" ]; then
      echo "note: port $MASTER_PORT on $MASTER_ADDR is taken (another process holds it): the" \
        "rendezvous uses port $chosen"
      MASTER_PORT=$chosen
    fi
  fi
  export RDZV_ENDPOINT="$MASTER_ADDR:$MASTER_PORT" RDZV_ID=$SLURM_JOB_ID
else
  job_id=$(date +%Y%m%d-%H%M%S)-$$
  job_name=${JOB_NAME:-local}
  submit_dir=$PWD
  nodes=("$(hostname -s)")
  nnodes=1
  unset RDZV_ENDPOINT  # torchrun --standalone picks a free port
fi
if [ "$mode" = python ] && [ "$nnodes" -gt 1 ]; then
  echo "warning: STRATEGY=dp runs one process on ${nodes[0]}; $((nnodes - 1)) node(s) stay idle"
  nnodes=1
fi
export NNODES=$nnodes
gpus_per_node=$(bash "$LAUNCH_DIR/node.sh" --gpus)  # same rule node.sh applies on each node
nproc=${NPROC_PER_NODE:-$gpus_per_node}
gpus_shown=$gpus_per_node
if ! bash "$LAUNCH_DIR/node.sh" --gpus-seen; then
  gpus_shown="none seen (a CPU run: each process stands in for a GPU)"
fi
if [ "$mode" = python ]; then
  world_size=1 per_node="one process for all GPUs"
else
  world_size=$((nnodes * nproc)) per_node="$nproc per node"
fi

continued=""
if [ -n "${RUN_DIR:-}" ]; then
  if [ -e "$RUN_DIR" ] && [ ! -d "$RUN_DIR" ]; then
    echo "error: RUN_DIR=$RUN_DIR is a file: name the run directory to continue, or unset" \
      "RUN_DIR for a new one (RUNS_DIR sets the folder new ones go in)" >&2
    exit 2
  fi
  if [ ! -d "$RUN_DIR" ]; then
    echo "error: RUN_DIR=$RUN_DIR does not exist: unset RUN_DIR for a new run directory, or" \
      "name an existing one to continue it" >&2
    exit 2
  fi
  # a folder of runs (RUNS_DIR's), or /tmp, took train.log, job.env and the logs' folders
  if [ ! -f "$RUN_DIR/job.env" ]; then
    echo "error: RUN_DIR=$RUN_DIR is not a run directory (no job.env): name one the" \
      "launcher made (RUNS_DIR/<job>-<id>) to continue it, or set RUNS_DIR, not RUN_DIR, for" \
      "the folder new runs go in" >&2
    exit 2
  fi
  echo "continuing in RUN_DIR=$RUN_DIR"
  continued=1
else
  RUN_DIR="${RUNS_DIR:-$submit_dir/runs}/$job_name-$job_id"
fi
for arg in "$@"; do  # the training arguments' own --checkpoint-dir wins over CHECKPOINT_DIR
  case $arg in  # argparse's abbreviations too: --checkpoint-d was overridden by ours, silently
    --checkpoint-d | --checkpoint-di | --checkpoint-dir | --checkpoint-d=* | --checkpoint-di=* | \
      --checkpoint-dir=*) CHECKPOINT_DIR="" ;;
  esac
done
# A CHECKPOINT_DIR that is a file: refused here, not by the training once torchrun ran it,
# as --checkpoint-dir, with torchrun's report below (and a run directory left behind)
if [ -n "${CHECKPOINT_DIR:-}" ] && [ -e "$CHECKPOINT_DIR" ] && [ ! -d "$CHECKPOINT_DIR" ]; then
  echo "error: CHECKPOINT_DIR=$CHECKPOINT_DIR is a file: name a folder for the checkpoints," \
    "or unset it for \$RUN_DIR/checkpoints (CHECKPOINT_DIR= for none)" >&2
  exit 2
fi
# (-w too: mkdir -p succeeds on a continued run's folders on a read-only file system)
if ! mkdir -p "$RUN_DIR/gpu_memory" "$RUN_DIR/cpu_memory" 2>/dev/null || [ ! -w "$RUN_DIR" ]; then
  fix="set RUNS_DIR to a writable folder (default: runs/ where you start or submit the job)"
  if [ -n "$continued" ]; then fix="make RUN_DIR writable, or unset it for a new run directory"; fi
  echo "error: cannot create the run directory $RUN_DIR (and its gpu_memory/, cpu_memory/):" \
    "$fix" >&2
  exit 2
fi
RUN_DIR=$(cd "$RUN_DIR" && pwd)
export RUN_DIR

# Training arguments added here: checkpoints in the run directory (so a requeued job resumes),
# and --check for CHECK_ONLY=1.
extra_args=()
: "${CHECKPOINT_DIR=$RUN_DIR/checkpoints}"  # (set but empty: none, or the arguments' own)
if [ -n "$CHECKPOINT_DIR" ]; then extra_args+=(--checkpoint-dir "$CHECKPOINT_DIR"); fi
if [ "$check_only" = 1 ]; then extra_args+=(--check); fi

launch=()
if [ -n "${SLURM_JOB_ID:-}" ]; then
  # One task per node. srun of Slurm 22.05 to 23.02 no longer inherits --cpus-per-task from
  # sbatch (the task gets one CPU and its loader workers starve): pass it, and export
  # SRUN_CPUS_PER_TASK, which srun reads, for any srun started under this job (site.sh's,
  # SRUN_EXTRA_ARGS'). training/allocation.py warns when a task still has fewer CPUs.
  # --export=ALL: this job's environment (site.sh's included) for the step, also where sbatch
  # ran with --export=NONE (some sites' default), which srun would inherit: no PATH, no bash.
  # --gpus-per-node: the job's GPUs, also where `sbatch --gres=gpu:2` overrode the file's
  # --gpus-per-node=4, whose SLURM_GPUS_PER_NODE=4 srun would inherit and ask for.
  launch=(srun --kill-on-bad-exit=1 --export=ALL --nodes="$nnodes" --ntasks="$nnodes"
    --ntasks-per-node=1)
  # (only then: SLURM_GPUS_ON_NODE is the batch node's, and nodes may differ, --gpus=6 on 2)
  if [ -n "${SLURM_GPUS_PER_NODE:-}" ] && [ -n "${SLURM_GPUS_ON_NODE:-}" ] &&
    [ "${SLURM_GPUS_PER_NODE#*:}" != "$SLURM_GPUS_ON_NODE" ]; then
    launch+=(--gpus-per-node="$SLURM_GPUS_ON_NODE")
  fi
  if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
  fi
  step_cpus=${SLURM_CPUS_PER_TASK:-}
  # `#SBATCH --ntasks-per-node=4`: Slurm gave the node 4 tasks' CPUs, and this one task (torchrun
  # starts the processes) got one task's share, the rest idle: it gets the node's CPUs instead
  # (where every node has as many: SLURM_JOB_CPUS_PER_NODE "16" or "16(x2)", not "16,8")
  if [[ ${SLURM_NTASKS_PER_NODE:-1} =~ ^[0-9]+$ ]] && [ "${SLURM_NTASKS_PER_NODE:-1}" -gt 1 ] &&
    [[ ${SLURM_JOB_CPUS_PER_NODE:-} =~ ^[0-9]+(\(x[0-9]+\))?$ ]]; then
    step_cpus=${SLURM_JOB_CPUS_PER_NODE%%(*}
    echo "note: the job asked for --ntasks-per-node=$SLURM_NTASKS_PER_NODE; the launchers start" \
      "one task per node (torchrun starts the training's processes in it), so it gets the" \
      "node's $step_cpus CPUs (\`#SBATCH --ntasks-per-node=1\` and --cpus-per-task say it" \
      "directly)"
  fi
  if [ -n "$step_cpus" ]; then launch+=(--cpus-per-task="$step_cpus"); fi
  read -ra srun_extra <<<"${SRUN_EXTRA_ARGS:-}"
  launch+=("${srun_extra[@]}")
fi
launch+=(bash "$LAUNCH_DIR/node.sh" "$mode" "$TRAIN_SCRIPT" "$@" "${extra_args[@]}")

# The data the training will read, as far as the launcher can tell from the arguments and
# DATA_DIR (the training's own "data:" line says what it found there).
data_dir=${DATA_DIR:-} dataset="" prev=""
for arg in "$@"; do
  case $prev in --data-dir) data_dir=$arg ;; --dataset) dataset=$arg ;; esac
  case $arg in --data-dir=*) data_dir=${arg#*=} ;; --dataset=*) dataset=${arg#*=} ;; esac
  prev=$arg
done
if [ "$dataset" = synthetic ]; then
  data_shown="built-in synthetic data (--dataset synthetic)"
elif [ -n "$data_dir" ]; then
  data_shown="${dataset:-tinyimagenet} at $data_dir"
elif [ -n "$dataset" ]; then
  data_shown="$dataset (from its default folder)"
else
  data_shown="built-in synthetic data (no --dataset, --data-dir or DATA_DIR)"
fi

gloo_shown="<auto>"  # node.sh's rule when GLOO_SOCKET_IFNAME is unset
if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then gloo_shown="<per node, from NCCL_SOCKET_IFNAME>"; fi
start=$(date '+%Y-%m-%d %H:%M:%S')
printf '%s=%q\n' JOB_ID "$job_id" JOB_NAME "$job_name" STRATEGY "$STRATEGY" \
  NODES "$nnodes" NODELIST "${nodes[*]:0:$nnodes}" GPUS_PER_NODE "$gpus_per_node" \
  NPROC_PER_NODE "$nproc" WORLD_SIZE "$world_size" TRAIN_SCRIPT "$TRAIN_SCRIPT" \
  TRAIN_ARGS "$*" COMMAND "${launch[*]}" REPO_DIR "$REPO_DIR" SUBMIT_DIR "$submit_dir" \
  RUN_DIR "$RUN_DIR" MASTER_ADDR "${MASTER_ADDR:-}" MASTER_PORT "${MASTER_PORT:-}" \
  PYTHON "$PYTHON" CHECKPOINT_DIR "$CHECKPOINT_DIR" RESTARTS "$restarts" START_TIME "$start" \
  >"$RUN_DIR/job.env"

cat <<EOF
============================================================
job id        : $job_id ($job_name)
strategy      : $STRATEGY -> $TRAIN_SCRIPT $*
nodes         : $nnodes (${nodes[*]:0:$nnodes})
GPUs per node : $gpus_shown
processes     : $world_size ($per_node)
rendezvous    : ${RDZV_ENDPOINT:-standalone}
data          : $data_shown
NCCL          : NCCL_DEBUG=$NCCL_DEBUG NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<auto>} \
GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$gloo_shown}
run dir       : $RUN_DIR
checkpoints   : ${CHECKPOINT_DIR:-none}
restarts      : $restarts
start         : $start
============================================================
EOF

if [ "$early_signal" = TERM ]; then  # kept by the trap at the top
  echo "job received SIGTERM at $early_at, before the training started: stopping"
  exit 143
fi

# ---- training: output to the job log and train.log; keep its exit code -----------------------
# The training runs in the background and this shell waits for it, because bash runs a trap only
# between commands: a foreground pipeline would hold back the stop signal until the very end.
stop_signal=""
resend_pid=""
# shellcheck disable=SC2317  # reached through the traps below
send_stop() {
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    # Every job step, not this shell; in the background, without train.log's pipe. For a job
    # Slurm is ending itself (scontrol requeue, scancel, preemption), scancel retries until
    # Slurm's SIGKILL: waited for, it held this shell and the pipe until then (KillWait, 30 s),
    # and the attempt never printed its exit code and memory summary.
    scancel --signal="$1" "$SLURM_JOB_ID" >/dev/null 2>&1 {log_fd}>&- &
  else
    kill -s "$1" "$launch_pid" 2>/dev/null || true  # node.sh forwards it to the training
  fi
}
# Every node.sh has set its USR1 trap once it says "[node] running: ..." (at most 30 s waited:
# node.sh ignores a USR1 until then, this only spares the sends that would be ignored).
# shellcheck disable=SC2317
nodes_ready() {
  local waited=0 running
  while [ "$waited" -lt 30 ] && kill -0 "$launch_pid" 2>/dev/null; do
    running=$(tail -c +"$((log_size + 1))" "$RUN_DIR/train.log" | grep -o '\] running: ' | wc -l \
      || true)
    [ "$running" -lt "$nnodes" ] || return 0
    sleep 1
    waited=$((waited + 1))
  done
}
# shellcheck disable=SC2317
forward_stop() {  # SIGNAL [later: once every node.sh is running the training, not now]
  [ -z "$stop_signal" ] || return 0
  stop_signal=$1
  echo "job received SIG$1 at ${early_at:-$(date +%H:%M:%S)}: asking the training to checkpoint" \
    "and stop"
  if [ "${2:-}" != later ]; then send_stop "$1"; fi
  # SIGTERM reaches every process of the job from Slurm itself. A USR1 that lands before the
  # training has installed its handler (start-up) or before the step exists would be lost:
  # repeat it every 10 s until the training has stopped (the handler only sets a flag).
  [ "$1" = USR1 ] || return 0
  (
    trap - USR1
    # Killed once the training has ended: its sleep goes with it. Left running, the sleep would
    # hold the job's output and train.log's pipe open, and the job would wait up to 10 s for
    # its tee (and whoever reads its output for the end of it).
    exec {log_fd}>&-
    sleeper=
    trap 'kill $sleeper 2>/dev/null || true; exit 0' TERM
    if [ "${2:-}" = later ]; then
      nodes_ready
      send_stop "$1"
    fi
    while kill -0 "$launch_pid" 2>/dev/null; do
      sleep 10 &
      sleeper=$!
      wait "$sleeper" || true
      send_stop "$1"
    done
  ) &
  resend_pid=$!
}

log_size=$(stat -c %s "$RUN_DIR/train.log" 2>/dev/null || echo 0)
# The tee that writes train.log ignores the stop signals: Slurm ends a job (scontrol requeue,
# scancel, preemption) with a SIGTERM to every process of it, and a tee that died of it first
# would lose what the training prints on its way out (its checkpoint sentence and [STOP] line).
# It ends when the training's output does (EOF), or at Slurm's SIGKILL.
exec {log_fd}> >(trap '' TERM INT HUP USR1; exec tee -a "$RUN_DIR/train.log")
tee_pid=$!
"${launch[@]}" >&"$log_fd" 2>&1 &
launch_pid=$!
trap 'forward_stop USR1' USR1
trap 'forward_stop TERM' TERM
# Ctrl-C reaches every process of the terminal's job: the training ends with its own sentence,
# and this shell, which died of it, printed neither the exit code nor the memory summary
interrupted=""
trap 'interrupted=1' INT
# A hang-up (the terminal or ssh connection of a local run closed) reaches every process of the
# terminal's job too: the training ends with torchrun's 129, and this shell died of it without
# the exit code, the memory summary or job.env's EXIT_CODE. From the hang-up on, its own lines
# go to train.log: the terminal is gone, and a write to it fails (and ends this shell, set -e).
hung_up=""
trap 'hung_up=1; exec >>"$RUN_DIR/train.log" 2>&1' HUP
case $early_signal in  # one that came before: a USR1 once node.sh has its own trap
  USR1) forward_stop USR1 later ;;
  TERM) forward_stop TERM ;;
esac
rc=0
wait_for "$launch_pid" || rc=$?
trap - USR1 TERM INT
if [ -n "$resend_pid" ]; then kill "$resend_pid" 2>/dev/null || true; fi
exec {log_fd}>&-
wait "$tee_pid" 2>/dev/null || true

# Did the training stop after checkpointing for a requeue? dp_train.py exits 75 itself; torchrun
# turns its workers' 75 into 1, so also read rank 0's machine line from this attempt's part of
# train.log: "[STOP] signal=SIGUSR1 epoch=2 step=15 saved=1 exit_code=75" (contract.STOP_LINE).
# Not `tail | grep -q` under pipefail: grep leaves at the match, tail may still be writing the
# lines after it (torchrun's failure report) and die of SIGPIPE, and the pipeline then fails.
# What NCCL's watchdog and torchrun print when a rank is aborted (torch's ProcessGroupNCCL), and
# the start of the sentence the training prints itself for a failed collective (faults.py).
NCCL_ABORT_RE='Watchdog caught collective operation timeout|[Ww]atchdog thread terminated with'
NCCL_ABORT_RE+=' exception|NCCL communicator was aborted|taking the entire process down'
NCCL_ABORT_RE+='|Signal 6 \(SIGABRT\)|exitcode *: *-6'
COLLECTIVE_SENTENCE="a collective with the other ranks failed or timed out"
requeue_ckpt=0
if grep -q '\[STOP\] .* saved=1 ' < <(tail -c +"$((log_size + 1))" "$RUN_DIR/train.log")
then
  requeue_ckpt=1
  rc=75
# torchrun reports a worker's own exit code (2: a problem to fix, 3: NaN loss) as 1 too (and
# srun the 143 of another node's task it ended); the worker says it in "[EXIT] code=2 rank=0"
# (contract.EXIT_LINE)
elif [ "$rc" != 0 ] && exit_line=$(grep -o -m1 '\[EXIT\] code=[0-9]*' \
  < <(tail -c +"$((log_size + 1))" "$RUN_DIR/train.log")); then
  rc=${exit_line##*=}
# On GPUs a collective that fails or times out (after --dist-timeout, the process group's
# timeout) is caught by NCCL's watchdog, which aborts the process (SIGABRT): the training's own
# sentence for it (faults.collective_failed) never comes, torchrun reports "exitcode: -6" and 1,
# srun a python's 134. Say it here, once, from NCCL's lines and the abort in this attempt's log.
elif [ "$rc" != 0 ] && abort_line=$(grep -E -m1 "$NCCL_ABORT_RE" \
  < <(tail -c +"$((log_size + 1))" "$RUN_DIR/train.log")); then
  if ! grep -q "$COLLECTIVE_SENTENCE" < <(tail -c +"$((log_size + 1))" "$RUN_DIR/train.log")
  then
    abort_line=${abort_line#"${abort_line%%[![:space:]]*}"}  # without its indentation
    echo "error: $COLLECTIVE_SENTENCE: NCCL's watchdog aborted a rank (${abort_line:0:200});" \
      "another rank probably died first: look for its error above, or raise --dist-timeout if" \
      "the job is merely slow" >&2
  fi
  rc=1
fi
if [ -n "$interrupted" ] && [ "$rc" != 0 ] && [ "$rc" != 75 ]; then
  rc=130 stop_signal=INT
elif [ -n "$hung_up" ] && [ "$rc" != 0 ] && [ "$rc" != 75 ]; then
  rc=129 stop_signal=HUP
fi
echo "training exit code: $rc${stop_signal:+ (after SIG$stop_signal)}"

# ---- memory summary: printed and saved; a failure here never replaces the training result ----
shopt -s nullglob
logs=("$RUN_DIR"/gpu_memory/*.csv "$RUN_DIR"/cpu_memory/*.txt)
analyze="$REPO_DIR/analyze_memory.py"
if [ ! -f "$analyze" ]; then
  echo "memory summary skipped: $analyze not found"
elif [ ${#logs[@]} -eq 0 ]; then
  echo "memory summary skipped: no memory logs in $RUN_DIR"
else
  echo "== memory summary ($RUN_DIR/memory_summary.txt)"
  set +e
  # analyze_memory.py walks the run directory and reads only files that look like memory logs.
  "${python_cmd[@]}" "$analyze" "$RUN_DIR" 2>&1 | tee "$RUN_DIR/memory_summary.txt"
  arc=${PIPESTATUS[0]}
  # 1: some logs summarised, another bad (a failing nvidia-smi's error text in its CSV): the
  # JSON keeps the good ones, and names the bad one among its problems
  if [ "$arc" -le 1 ]; then
    "${python_cmd[@]}" "$analyze" --json "$RUN_DIR" >"$RUN_DIR/memory_summary.json"
    jrc=$?
    if [ "$jrc" -gt 1 ]; then arc=$jrc; fi
  fi
  set -e
  if [ "$arc" -ne 0 ]; then
    echo "warning: memory analysis failed (exit $arc); the job keeps the training exit code $rc"
  fi
fi

end=$(date '+%Y-%m-%d %H:%M:%S')
printf '%s=%q\n' END_TIME "$end" EXIT_CODE "$rc" >>"$RUN_DIR/job.env"
echo "end           : $end (exit code $rc)"

# ---- requeue after a stop checkpoint -----------------------------------------------------------
if [ "$stop_signal" = HUP ]; then
  again="bash launch/local.sh"
  if [ -n "${SLURM_JOB_ID:-}" ]; then again=sbatch; fi
  how="it saved no checkpoint: start it again"
  if [ -n "$CHECKPOINT_DIR" ] && compgen -G "$CHECKPOINT_DIR/ckpt-*" >/dev/null; then
    how="continue from its last checkpoint with RUN_DIR=$RUN_DIR $again ..."
  fi
  echo "the terminal hung up (its window or ssh connection closed): the training was ended;" \
    "$how, and start a long run under tmux, screen or nohup so that it outlives the terminal"
elif [ "$requeue_ckpt" = 1 ] && [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "stopped after a checkpoint: continue with RUN_DIR=$RUN_DIR bash launch/local.sh ..."
elif [ "$requeue_ckpt" = 1 ]; then
  # Only a RUNNING job is requeued: not one being cancelled, nor one whose state is unknown.
  # One whose restart count has grown past this attempt's was requeued by Slurm already
  # (scontrol requeue, preemption): its SIGTERM stopped the training.
  info=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null || true)
  state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$info")
  slurm_restarts=$(sed -n 's/.* Restarts=\([0-9]*\).*/\1/p' <<<"$info")
  if [ "${slurm_restarts:-0}" -gt "$restarts" ]; then
    echo "job $SLURM_JOB_ID was requeued by Slurm (scontrol requeue or preemption): it resumes" \
      "from ${CHECKPOINT_DIR:-its checkpoint} when it starts again"
  elif [ "$requeue" != 1 ] || [ "$state" != RUNNING ]; then
    echo "stopped after a checkpoint; not requeued (REQUEUE=${REQUEUE:-1}, job state" \
      "${state:-unknown}): continue with RUN_DIR=$RUN_DIR sbatch ..."
  elif scontrol requeue "$SLURM_JOB_ID"; then
    # Slurm ends this attempt now and starts the job again later, in this run directory.
    echo "requeued job $SLURM_JOB_ID: it resumes from ${CHECKPOINT_DIR:-its checkpoint} when it" \
      "starts again"
  else
    echo "warning: scontrol requeue $SLURM_JOB_ID failed: continue with RUN_DIR=$RUN_DIR sbatch ..."
  fi
fi
exit "$rc"
}
