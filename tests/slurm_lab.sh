#!/bin/bash
# A real Slurm 22.05 cluster on ONE host, for testing the launchers (Debian 12, root, no GPU,
# no systemd): munged + slurmctld + one slurmd per emulated node n1..nN, each with fake GPUs.
#
#   tests/slurm_lab.sh install               apt-get install slurmctld slurmd slurm-client munge
#   tests/slurm_lab.sh up                    write configs, start the daemons, wait until all idle
#   tests/slurm_lab.sh down                  stop what 'up' started (munged only if 'up' started it)
#   tests/slurm_lab.sh wait JOBID [TIMEOUT]  poll until the job ends; print "job ID: STATE
#                                            ExitCode=X:Y"; exit 0 iff COMPLETED
#   tests/slurm_lab.sh env                   print the SLURM_CONF line to export for sbatch/sinfo
#
# Knobs (environment): LAB (/tmp/slurmlab-$USER), NNODES (4), CPUS per node (32), GPUS per
# node (8), FEATURES (node features, e.g. "v100"; empty = none), CTLD_PORT (6817),
# NODE_PORT (17001: slurmd ports NODE_PORT..NODE_PORT+NNODES-1).
# Client commands need SLURM_CONF=$LAB/etc/slurm.conf (this script exports it for itself).
#
# Why it is built this way (each point was needed on Slurm 22.05):
# - every node is NodeAddr=127.0.0.1 with its own slurmd port; the node names go into /etc/hosts
#   so "n1" works as MASTER_ADDR. Inside a job `hostname` is the same on every node: use
#   $SLURMD_NODENAME to tell nodes apart.
# - a GPU GRES without File= drains the node, so each fake GPU is a symlink to /dev/null; jobs
#   then get SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES as on a real cluster.
# - SlurmdParameters=config_overrides lets a node claim more CPUs than the host has.
# - EnforcePartLimits=ALL rejects impossible requests at sbatch instead of pending forever.
# - no accounting: MinJobAge=600 keeps finished jobs visible to `scontrol show job` (for 'wait').
# - state and spool are wiped at every 'up' (a drained node would be remembered).
# - exited daemons can linger as zombies: "alive" checks the process state, not kill -0.
set -euo pipefail

LAB=${LAB:-/tmp/slurmlab-${USER:-$(id -un)}}
NNODES=${NNODES:-4}
CPUS=${CPUS:-32}
GPUS=${GPUS:-8}
FEATURES=${FEATURES:-}
CTLD_PORT=${CTLD_PORT:-6817}
NODE_PORT=${NODE_PORT:-17001}
export SLURM_CONF="$LAB/etc/slurm.conf"
HOSTS_MARK="# slurm_lab.sh nodes"

alive() {  # a zombie counts as dead
  local s
  s=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $s != Z* ]]
}

install_pkgs() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  slurmctld -V
}

write_configs() {
  mkdir -p "$LAB"/{etc,state,spool,log,run,dev}
  local feat="" ctlhost last_port
  [ -n "$FEATURES" ] && feat="Feature=$FEATURES"
  ctlhost=$(hostname -s)
  last_port=$((NODE_PORT + NNODES - 1))
  cat >"$SLURM_CONF" <<EOF
# Slurm 22.05: $NNODES emulated nodes on ONE host (written by tests/slurm_lab.sh).
ClusterName=lab
SlurmctldHost=$ctlhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$LAB/run/slurmctld.pid
SlurmdPidFile=$LAB/run/slurmd-%n.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# The main scheduling loop every 2 s, not 60: a job made eligible by time alone (a requeued
# job's StartTime) otherwise waited up to a minute for it (29 s in the time-limit test).
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
MinJobAge=600
# Slurm's default delay of the SIGKILL after a step's SIGTERM. At 5 s a node's "loggers
# stopped" line went missing once in CI (a loaded 2-core box; probably this SIGKILL).
KillWait=30
GresTypes=gpu
NodeName=n[1-$NNODES] NodeHostname=n[1-$NNODES] NodeAddr=127.0.0.1 Port=[$NODE_PORT-$last_port] CPUs=$CPUS RealMemory=64000 Gres=gpu:$GPUS $feat State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # File= must name a char/block device: symlinks to /dev/null. The trailing digit is the index.
  local i
  for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$LAB/dev/nvidia$i"; done
  cat >"$LAB/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=n[1-$NNODES] Name=gpu File=$LAB/dev/nvidia[0-$((GPUS - 1))]
EOF
  # Node names must resolve (MASTER_ADDR = first node). Rewrite in place: /etc/hosts may be a
  # bind mount that cannot be replaced by a rename.
  local names hosts
  names=$(for ((i = 1; i <= NNODES; i++)); do printf 'n%d ' "$i"; done)
  hosts=$(grep -v "$HOSTS_MARK" /etc/hosts || true)
  printf '%s\n127.0.0.1 %s%s\n' "$hosts" "$names" "$HOSTS_MARK" >/etc/hosts
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    echo "munged already running (left alone by 'down')"
    return
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force 2>/dev/null ||
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  touch "$LAB/run/munged.ours"
  for _ in $(seq 50); do
    munge -n | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  echo "munged did not come up" >&2
  return 1
}

up() {
  local t0 i
  t0=$(date +%s%3N)
  for cmd in slurmctld slurmd sinfo munged; do
    command -v "$cmd" >/dev/null || [ -x "/usr/sbin/$cmd" ] ||
      { echo "$cmd not found: run '$0 install' first (as root)" >&2; return 2; }
  done
  if ls "$LAB"/run/*.pid >/dev/null 2>&1; then down; fi  # leftovers from an aborted run
  write_configs
  start_munge
  rm -rf "${LAB:?}"/state/* "${LAB:?}"/spool/* "${LAB:?}"/log/*
  for ((i = 1; i <= NNODES; i++)); do mkdir -p "$LAB/spool/n$i"; done
  slurmctld -f "$SLURM_CONF"
  for ((i = 1; i <= NNODES; i++)); do slurmd -N "n$i" -f "$SLURM_CONF"; done
  for _ in $(seq 240); do  # up to 60 s
    if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "$NNODES" ]; then
      echo "slurm up: $NNODES nodes idle after $(($(date +%s%3N) - t0)) ms (SLURM_CONF=$SLURM_CONF)"
      sinfo -N
      return 0
    fi
    sleep 0.25
  done
  echo "slurm did not become ready" >&2
  sinfo -N -l >&2 || true
  tail -20 "$LAB"/log/*.log >&2 || true
  return 1
}

down() {
  local pids="" f p any
  for f in "$LAB"/run/slurmctld.pid "$LAB"/run/slurmd-*.pid; do
    if [ -s "$f" ]; then pids+=" $(cat "$f")"; fi
  done
  if ! scontrol shutdown >/dev/null 2>&1; then
    for p in $pids; do kill "$p" 2>/dev/null || true; done
  fi
  for _ in $(seq 120); do  # up to 30 s
    any=0
    for p in $pids; do if alive "$p"; then any=1; fi; done
    [ "$any" = 0 ] && break
    sleep 0.25
  done
  for p in $pids; do
    if alive "$p"; then echo "force-killing $p" >&2; kill -9 "$p" 2>/dev/null || true; fi
  done
  if [ -e "$LAB/run/munged.ours" ] && [ -s /run/munge/munged.pid ]; then
    p=$(cat /run/munge/munged.pid)
    kill "$p" 2>/dev/null || true
    for _ in $(seq 40); do alive "$p" || break; sleep 0.25; done
  fi
  rm -f "$LAB"/run/*.pid "$LAB/run/munged.ours"
  echo "slurm down"
}

wait_job() {
  local id=${1:?usage: $0 wait JOBID [TIMEOUT_S]} t=${2:-600} line st="" reason="" k
  for ((k = 0; k < t * 4; k++)); do
    line=$(scontrol -o show job "$id" 2>/dev/null) ||
      { echo "job $id unknown (purged?)" >&2; return 99; }
    st=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$line")
    reason=$(sed -n 's/.* Reason=\([^ ]*\).*/\1/p' <<<"$line")
    case $st in
      PENDING)
        case $reason in  # reasons that can never clear on this cluster: fail fast
          PartitionNodeLimit | BadConstraints | PartitionConfig | InvalidAccount | InvalidQOS | \
            JobHeldAdmin | JobHeldUser | DependencyNeverSatisfied)
            echo "job $id: stuck PENDING ($reason)" >&2
            scancel "$id" || true
            return 97
            ;;
        esac
        sleep 0.25
        ;;
      CONFIGURING | RUNNING | COMPLETING | SUSPENDED | REQUEUED | RESIZING | SIGNALING | STAGE_OUT)
        sleep 0.25
        ;;
      *)
        echo "job $id: $st $(grep -o 'ExitCode=[0-9:]*' <<<"$line" | head -1)"
        [ "$st" = COMPLETED ]
        return
        ;;
    esac
  done
  echo "job $id: timeout after ${t}s (state $st, reason $reason)" >&2
  scancel "$id" || true
  return 98
}

case ${1:-} in
  install) install_pkgs ;;
  up) up ;;
  down) down ;;
  wait) shift; wait_job "$@" ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) echo "usage: $0 install|up|down|wait JOBID [TIMEOUT]|env" >&2; exit 2 ;;
esac
