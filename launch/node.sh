#!/bin/bash
# Per-node wrapper: start the memory loggers on THIS node, run the training launcher, stop the
# loggers on every exit path. launch/job.sh starts it once per node (`srun --ntasks-per-node=1`
# under Slurm, directly without Slurm), so the GPU logger runs inside the step that owns the
# node's GPUs (cgroup device constraints) and every node writes its own logs.
#
#   node.sh torchrun SCRIPT [ARGS...]   one torchrun on this node, NPROC_PER_NODE workers
#   node.sh python SCRIPT [ARGS...]     one plain python process (dp: one process, all GPUs)
#   node.sh --gpus                      print the number of GPUs on this node and exit
#   node.sh --gpus-seen                 exit 0 when this node has GPUs at all, else 1
#
# Environment (set by job.sh; defaults work for a single node):
#   RUN_DIR          run directory (required): logs go to gpu_memory/<node>.csv and
#                    cpu_memory/<node>.txt (<node>.restart<N>.* when the run directory already has them)
#   NODE_NAME        log file name ($SLURMD_NODENAME, else `hostname -s`)
#   LOG_INTERVAL     seconds between memory samples (5; nvidia-smi rounds down, at least 1)
#   PYTHON           interpreter command, split on spaces (python)
#   NPROC_PER_NODE   workers per node (default: GPUs on this node, see gpus_on_node)
#   NNODES           torchrun --nnodes ($SLURM_NNODES, else 1)
#   RDZV_ENDPOINT    host:port of the c10d rendezvous; unset = torchrun --standalone
#   RDZV_ID          rendezvous id ($SLURM_JOB_ID, else "local")
#   NVIDIA_SMI, PSRECORD   logger commands (nvidia-smi, psrecord); a missing one is skipped.
#                    PSRECORD unset: the psrecord of PYTHON's environment (PYTHON -m psrecord),
#                    else the one on PATH
#   OMP_NUM_THREADS  default: CPUs of the task (at most `nproc`) / workers on the node, >= 1
#
# Signals: SIGUSR1 (job.sh forwards Slurm's time-limit warning) is passed on to the training
# processes only: torchrun's workers, or the one dp process. Everything this script starts runs
# with SIGUSR1 ignored, so a USR1 sent to the whole step cannot kill torchrun or a logger; the
# training scripts install their own handler. SIGTERM ends the training (torchrun forwards it to
# its workers, which checkpoint and exit 75) and then the loggers. torchrun runs as
# launch/torchrun_once.py, which acts on the first stop signal only: a SIGTERM to every process
# of the job reaches it, and this script passes it on once more.
# The script is one { } block, which bash reads whole before it runs any of it: bash reads a
# script as it runs it, so an edit of this file while a job runs (hours) would otherwise
# become the rest of that job.
# Until the USR1 trap below is set, a USR1 is ignored, not fatal (it may reach this script while
# it starts, on a loaded node seconds after srun): job.sh sends it again until the training stops.
trap '' USR1
# USR2 asks the training processes for their Python stacks (docs/hangs.md): ignored here and in
# everything this script starts, so `scancel --signal=USR2 JOBID`, which reaches every process
# of the step, ends none (the training scripts install their own handler)
trap '' USR2
{
set -euo pipefail
launch_dir=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=/dev/null  # launch/lib.sh, checked on its own
source "$launch_dir/lib.sh"

# GPUs on this node: what Slurm gave the step, else the CUDA_VISIBLE_DEVICES list (set but empty:
# GPUs hidden, 1), else, outside Slurm, the GPUs nvidia-smi lists, else 1. (A Slurm job that asked
# for no GPUs gets 1, not the node's GPUs that other jobs may own.)
gpus_on_node() {
  local devices listed
  if [[ ${SLURM_GPUS_ON_NODE:-} =~ ^[1-9][0-9]*$ ]]; then
    echo "$SLURM_GPUS_ON_NODE"
  elif [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    IFS=, read -ra devices <<<"$CUDA_VISIBLE_DEVICES"
    echo "$((${#devices[@]} > 0 ? ${#devices[@]} : 1))"
  elif [ -z "${SLURM_JOB_ID:-}" ]; then
    listed=$(timeout -k 5 15 "${NVIDIA_SMI:-nvidia-smi}" -L 2>/dev/null | grep -c '^GPU ' || true)
    if [[ $listed =~ ^[1-9][0-9]*$ ]]; then echo "$listed"; else echo 1; fi
  else
    echo 1
  fi
}

# Whether this node has GPUs at all, by the same signs: without any, gpus_on_node's 1 is the
# process count of a CPU run, not a GPU.
gpus_seen() {
  local listed
  if [[ ${SLURM_GPUS_ON_NODE:-} =~ ^[1-9][0-9]*$ ]]; then return 0; fi
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    [ -n "$CUDA_VISIBLE_DEVICES" ] && [ "$CUDA_VISIBLE_DEVICES" != -1 ]
    return
  fi
  listed=$(timeout -k 5 15 "${NVIDIA_SMI:-nvidia-smi}" -L 2>/dev/null | grep -c '^GPU ' || true)
  [[ $listed =~ ^[1-9][0-9]*$ ]]
}

if [ "${1:-}" = --gpus ]; then
  gpus_on_node
  exit 0
fi
if [ "${1:-}" = --gpus-seen ]; then
  gpus_seen
  exit
fi
if [ $# -lt 2 ] || { [ "$1" != torchrun ] && [ "$1" != python ]; }; then
  echo "usage: $0 torchrun|python SCRIPT [ARGS...]  |  $0 --gpus  |  $0 --gpus-seen" >&2
  exit 2
fi
launcher=$1
shift

: "${RUN_DIR:?RUN_DIR must name the run directory (launch/job.sh sets it)}"
: "${LOG_INTERVAL:=5}"
: "${PYTHON:=python}"
: "${NVIDIA_SMI:=nvidia-smi}"
node=${NODE_NAME:-${SLURMD_NODENAME:-$(hostname -s)}}
read -ra python_cmd <<<"$PYTHON"
nproc=${NPROC_PER_NODE:-$(gpus_on_node)}
if ! [[ $nproc =~ ^[1-9][0-9]*$ ]]; then
  echo "[$node] error: $nproc workers per node: NPROC_PER_NODE must be a positive integer" >&2
  exit 2
fi
# Split the task's CPUs between the workers (torchrun would otherwise force 1 with a warning);
# `nproc` caps it where Slurm does not bind CPUs and a node claims more CPUs than it has.
cpus=$(nproc)
if [ -n "${SLURM_CPUS_PER_TASK:-}" ] && [ "$SLURM_CPUS_PER_TASK" -lt "$cpus" ]; then
  cpus=$SLURM_CPUS_PER_TASK
fi
: "${OMP_NUM_THREADS:=$((cpus / nproc > 0 ? cpus / nproc : 1))}"
export OMP_NUM_THREADS

# gloo's interface on this node (the stop vote runs on a gloo group, and CPU runs train on
# gloo): the site's GLOO_SOCKET_IFNAME, else the interface NCCL_SOCKET_IFNAME names here (NCCL's
# prefixes and exclusions are not names gloo knows: "Unable to find address for: ^docker0").
if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then
  echo "[$node] gloo's interface: $GLOO_SOCKET_IFNAME (GLOO_SOCKET_IFNAME)"
elif [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
  gloo_if=$(gloo_ifname "$NCCL_SOCKET_IFNAME")
  if [ -n "$gloo_if" ]; then export GLOO_SOCKET_IFNAME=$gloo_if; fi
  if [ -n "$gloo_if" ]; then
    echo "[$node] gloo's interface: $gloo_if (from NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME)"
  else
    echo "[$node] gloo's interface: gloo chooses, the address of the host name" \
      "(NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME names no interface of this node)"
  fi
elif [ "${NNODES:-${SLURM_NNODES:-1}}" -gt 1 ] && [ -n "${MASTER_ADDR:-}" ]; then
  # neither set: the interface of this node's route to the others (not the host name's address)
  peer=$(gloo_peer "$node" "$MASTER_ADDR" "${PEER_ADDR:-}")
  gloo_if=$(route_ifname "$peer")
  if [ -n "$gloo_if" ]; then export GLOO_SOCKET_IFNAME=$gloo_if; fi
  if [ -n "$gloo_if" ]; then
    echo "[$node] gloo's interface: $gloo_if (the route to $peer)"
  else
    echo "[$node] gloo's interface: gloo chooses, the address of the host name (no" \
      "interface found on a route to ${peer:-another node})"
  fi
fi
echo "[$node] NCCL's interface: ${NCCL_SOCKET_IFNAME:-NCCL chooses (NCCL_SOCKET_IFNAME unset)}"

cmd=("${python_cmd[@]}")
if [ "$launcher" = torchrun ]; then
  # torchrun, from the chosen interpreter, acting on its first stop signal only (see there)
  cmd+=("$launch_dir/torchrun_once.py"
    --nnodes="${NNODES:-${SLURM_NNODES:-1}}" --nproc-per-node="$nproc")
  if [ -n "${RDZV_ENDPOINT:-}" ]; then
    cmd+=(--rdzv-backend=c10d --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-local}}"
      --rdzv-endpoint="$RDZV_ENDPOINT")
  else
    cmd+=(--standalone)
  fi
fi
cmd+=("$@")  # SCRIPT [ARGS...]

# A requeued or continued run (same RUN_DIR) keeps the earlier attempts' logs beside its own.
log_name=$node
attempt=0
while [ -e "$RUN_DIR/gpu_memory/$log_name.csv" ] || [ -e "$RUN_DIR/cpu_memory/$log_name.txt" ]; do
  attempt=$((attempt + 1))
  log_name="$node.restart$attempt"
done
gpu_log="$RUN_DIR/gpu_memory/$log_name.csv"
cpu_log="$RUN_DIR/cpu_memory/$log_name.txt"
mkdir -p "$RUN_DIR/gpu_memory" "$RUN_DIR/cpu_memory"
gpu_pid="" cpu_pid="" train_pid=""

# still_running PID...: whether one of these background jobs of this shell still runs, by
# bash's own job list (one listing for all of them). Only such a process is signalled: one that
# ended on its own (psrecord ends with the training) was reaped, and its pid may be another
# process's by now. The list alone is not enough: a child that Slurm's SIGTERM to the whole
# step ended while the TERM trap ran is reaped, yet listed as Running, so the process itself
# must still exist, and not as a zombie.
# shellcheck disable=SC2317  # reached through the EXIT trap
still_running() {
  local running p stat
  running=" $(jobs -pr | tr '\n' ' ') "
  for p in "$@"; do
    if [ -z "$p" ] || [[ $running != *" $p "* ]] || ! kill -0 "$p" 2>/dev/null; then continue; fi
    [ -d /proc/self ] || return 0  # no /proc: kill -0 has to do
    stat=$(cat "/proc/$p/stat" 2>/dev/null) || continue
    stat=${stat##*) }  # the state follows the command name, which may hold spaces
    [ "${stat%% *}" = Z ] || return 0
  done
  return 1
}

# Runs on every exit path (normal end, failure, set -e, scancel/kill-on-bad-exit via TERM).
# The loggers stop first: when another node fails, Slurm ends this node's task with SIGTERM and,
# KillWait seconds later (30 s by default, as in the test cluster), SIGKILL. A training that
# takes longer to stop must not keep this node from saying that its loggers are gone.
# shellcheck disable=SC2317  # reached through the EXIT trap
stop_all() {
  local rc=$? p tenths stopped=() killed=()
  trap - EXIT
  # Slurm sends SIGTERM to every process of the step when another node's task failed, often
  # as this node's own training ends: the TERM trap's exit would end this trap before the line
  # below (exit_ignoring_stops sets them aside earlier on its paths; this covers set -e's).
  # A second stop signal may end the wait for the training, not this.
  trap '' INT TERM HUP
  # job.sh sends SIGUSR1 to every process of the step every 10 s until the training has ended.
  # At its default, one would end still_running's subshell, and with it the check, or this trap
  # before it has stopped the loggers.
  trap '' USR1
  # A logger that does not answer SIGTERM (nvidia-smi stuck in the driver after a GPU fault)
  # gets SIGKILL 5 s later: with the stop signals ignored here, nothing else would end the wait.
  # Both loggers get SIGTERM at once and share the 5 s, so that this line comes well within
  # Slurm's KillWait even on a loaded node.
  for p in $gpu_pid $cpu_pid; do
    if still_running "$p"; then kill -TERM "$p" 2>/dev/null || true; fi
  done
  tenths=0
  while [ "$tenths" -lt 50 ] && still_running "$gpu_pid" "$cpu_pid"; do
    sleep 0.1
    tenths=$((tenths + 1))
  done
  for p in $gpu_pid $cpu_pid; do
    if still_running "$p"; then kill -KILL "$p" 2>/dev/null || true; killed+=("$p"); fi
    wait "$p" 2>/dev/null || true
    stopped+=("$p")
  done
  echo "[$node] loggers stopped (pids: ${stopped[*]:-none}${killed[*]:+; SIGKILL for ${killed[*]}, \
which ignored SIGTERM for 5 s}); exit code $rc"
  trap - INT TERM HUP
  if [ -n "$train_pid" ] && still_running "$train_pid"; then
    echo "[$node] waiting for the training to stop"
    kill -TERM "$train_pid" 2>/dev/null || true  # torchrun forwards it to its workers
    wait "$train_pid" 2>/dev/null || true
  fi
  exit "$rc"
}
# shellcheck disable=SC2317  # reached through the USR1 trap
forward_usr1() {
  [ -n "$train_pid" ] || return 0
  if [ "$launcher" = torchrun ]; then
    pkill -USR1 -P "$train_pid" || true  # the workers, not torchrun (USR1 would end it)
  else
    kill -USR1 "$train_pid" 2>/dev/null || true
  fi
  echo "[$node] SIGUSR1 passed on to the training processes"
}
# exit_ignoring_stops CODE: exit through stop_all with the stop signals already set aside.
# Slurm sends SIGTERM to the whole step, often more than once, and as this node's own training
# ends; one arriving before stop_all's first lines, which also set them aside, a moment too late
# under load, ended stop_all before its "loggers stopped" line.
# shellcheck disable=SC2317  # reached through the traps below
exit_ignoring_stops() {
  trap '' INT TERM HUP
  exit "$1"
}
trap stop_all EXIT
trap 'exit_ignoring_stops 143' TERM
trap 'exit_ignoring_stops 130' INT
trap 'exit_ignoring_stops 129' HUP
trap forward_usr1 USR1

# --data-cache: decode the dataset once on this node before the training starts. Inside the
# training it would run after the process group exists, and a long decode would count
# against --dist-timeout on the ranks that wait for it.
prepare_cache() {
  local arg prev="" data_dir=${DATA_DIR:-} cache="" wanted=0
  for arg in "$@"; do
    case $prev in
      --data-dir) data_dir=$arg ;;
      --data-cache) [[ $arg == -* ]] || cache=$arg ;;
    esac
    case $arg in
      --data-cache) wanted=1 ;;
      --data-cache=*) wanted=1 cache=${arg#*=} ;;
      --data-dir=*) data_dir=${arg#*=} ;;
    esac
    prev=$arg
  done
  if [ "$wanted" = 1 ] && [ -n "$data_dir" ]; then
    echo "[$node] preparing the data cache (prepare_tinyimagenet.py)"
    "${python_cmd[@]}" "${REPO_DIR:-$(dirname "$1")}/prepare_tinyimagenet.py" \
      --workers "$cpus" "$data_dir" ${cache:+"$cache"}
  fi
}
prepare_cache "$@"

if command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
  smi_interval=${LOG_INTERVAL%.*}  # nvidia-smi -l takes whole seconds
  [ "${smi_interval:-0}" -ge 1 ] 2>/dev/null || smi_interval=1
  # Memory columns first (analyze_memory.py's summary), then utilisation, power, SM clock and
  # temperature (a throttling GPU: a lower clock, a higher temperature than its neighbours).
  (trap '' USR1; exec "$NVIDIA_SMI" \
    --query-gpu=timestamp,index,name,memory.used,memory.total,utilization.gpu,power.draw,clocks.sm,temperature.gpu \
    --format=csv,nounits -l "$smi_interval") >"$gpu_log" &
  gpu_pid=$!
  echo "[$node] GPU memory log: $gpu_log (every ${smi_interval}s)"
else
  echo "[$node] nvidia-smi not found: GPU memory logging skipped"
fi

echo "[$node] running: ${cmd[*]}"
(trap '' USR1; exec "${cmd[@]}") &
train_pid=$!

# psrecord: $PSRECORD, else the one installed with the training's Python (PYTHON may name a
# venv that is not on PATH), else the one on PATH.
psrecord_cmd=()
if [ -n "${PSRECORD:-}" ]; then
  if command -v "$PSRECORD" >/dev/null 2>&1; then psrecord_cmd=("$PSRECORD"); fi
elif "${python_cmd[@]}" -c 'import psrecord' >/dev/null 2>&1; then
  psrecord_cmd=("${python_cmd[@]}" -m psrecord)
elif command -v psrecord >/dev/null 2>&1; then
  psrecord_cmd=(psrecord)
fi
if [ ${#psrecord_cmd[@]} -gt 0 ]; then
  # Its own messages go nowhere: only the log file belongs in the run directory.
  (trap '' USR1; exec "${psrecord_cmd[@]}" "$train_pid" --include-children \
    --interval "$LOG_INTERVAL" --log "$cpu_log") >/dev/null &
  cpu_pid=$!
  echo "[$node] CPU memory log: $cpu_log (every ${LOG_INTERVAL}s)"
elif [ -n "${PSRECORD:-}" ]; then
  echo "[$node] PSRECORD=$PSRECORD not found: CPU memory logging skipped"
else
  echo "[$node] psrecord is installed neither for $PYTHON nor on PATH: CPU memory logging" \
    "skipped (install it with: $PYTHON -m pip install psrecord)"
fi

rc=0
wait_for "$train_pid" || rc=$?  # through the USR1 trap, until the training has ended
train_pid=""
exit_ignoring_stops "$rc"  # the training has ended: a stop signal now would only cut the line
}
