#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to run the SLURM scripts (and their tests) under a real SLURM.
# As root on Debian or Ubuntu:
#   bash scripts/slurm/local_cluster.sh start   # install, configure, start; returns once the node is idle
#   bash scripts/slurm/local_cluster.sh stop    # cancel its jobs, stop what start started, remove its config
# start installs Debian's slurm-wlm and munge if missing (apt-get, after apt-get update when its package lists
# are empty or the install fails without one), writes /etc/slurm/slurm.conf for this machine (the node as
# `slurmd -C` sees it: its real CPU count; one partition, `local`; no GPUs, no accounting), starts munged (unless
# one answers already), slurmctld and slurmd, and waits until `sinfo` shows the node idle. Then submit as on
# any cluster, e.g. CPU=1 DATA=data-bin/sample sbatch --gpus-per-node=0 --ntasks-per-node=1 --cpus-per-task=1 \
# scripts/slurm/train.sbatch tnn_lm_tiny (docs/training.md#slurm). A requeued job restarts after about 10 s
# (AuthInfo=cred_expire=10; SLURM's default is 2 minutes).
# stop stops only the daemons start started (their process ids are in STATE_DIR/started), after cancelling
# the cluster's jobs, and removes the slurm.conf start wrote; the packages stay installed.
# start refuses an /etc/slurm/slurm.conf it did not write (another cluster's) and does nothing when a
# cluster answers already (sinfo works): stop then has nothing to stop.
# Knobs (environment variables, defaults in brackets): STATE_DIR [/tmp/fairseq-tnn-slurm]: the daemons' state,
# spool, logs and process ids; START_TIMEOUT [60]: seconds to wait for the node to be idle.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/slurm/local_cluster.sh start|stop   (as root; settings are environment variables)"
[[ $# -eq 1 && ( "$1" == start || "$1" == stop ) ]] || usage_error
STATE_DIR="${STATE_DIR:-/tmp/fairseq-tnn-slurm}"
START_TIMEOUT="${START_TIMEOUT:-60}"
is_pos_int "$START_TIMEOUT" || die "START_TIMEOUT must be a whole number of seconds, not '$START_TIMEOUT'" 2
CONF=/etc/slurm/slurm.conf
MARK="# written by fairseq-tnn scripts/slurm/local_cluster.sh"
STARTED="$STATE_DIR/started"  # "<name> <pid>" per daemon start started, "conf" when it wrote CONF

conf_is_ours() { [[ "$(head -c ${#MARK} "$CONF" 2> /dev/null)" == "$MARK" ]]; }

munge_answers() { command -v munge > /dev/null && munge -n 2> /dev/null | unmunge > /dev/null 2>&1; }

install_packages() {
  local missing=() cmd
  for cmd in munged slurmctld slurmd sbatch; do command -v "$cmd" > /dev/null || missing+=("$cmd"); done
  (( ${#missing[@]} == 0 )) && return
  command -v apt-get > /dev/null || die "${missing[*]} not found and no apt-get: install SLURM (slurm-wlm) and munge yourself"
  say "installing slurm-wlm and munge (missing: ${missing[*]})"
  local install=(apt-get install -y -q --no-install-recommends slurm-wlm munge)
  if ! compgen -G "/var/lib/apt/lists/*_Packages" > /dev/null || ! DEBIAN_FRONTEND=noninteractive "${install[@]}"; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${install[@]}"
  fi
}

write_conf() {
  local node host
  node="$(slurmd -C | head -n 1)"  # NodeName=<host> CPUs=... Boards=... RealMemory=...: what slurmd will find
  [[ "$node" == NodeName=* ]] || die "slurmd -C did not describe this node: '$node'"
  host="${node%% *}"; host="${host#NodeName=}"
  mkdir -p /etc/slurm "$STATE_DIR/ctld" "$STATE_DIR/d" "$STATE_DIR/log"
  cat > "$CONF" <<EOF
$MARK (STATE_DIR=$STATE_DIR); 'local_cluster.sh stop' removes it
ClusterName=fairseq-tnn-local
SlurmctldHost=$host(127.0.0.1)
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
SlurmUser=root
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
KillWait=5
SchedulerParameters=sched_interval=2
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
EOF
  echo conf >> "$STARTED"
}

# start_daemon NAME PIDFILE COMMAND...: run a daemon that writes PIDFILE; record its pid in STARTED.
start_daemon() {
  local name="$1" pidfile="$2" i
  shift 2
  rm -f "$pidfile"
  "$@" || die "$name did not start (its log: $STATE_DIR/log/$name.log or /var/log/munge/munged.log)"
  for (( i = 0; i < 100; i++ )); do [[ -s "$pidfile" ]] && break; sleep 0.1; done
  [[ -s "$pidfile" ]] || die "$name wrote no process id to $pidfile"
  echo "$name $(cat "$pidfile")" >> "$STARTED"
}

start() {
  [[ "$(id -u)" == 0 ]] || die "start installs packages and starts daemons: run it as root"
  if command -v sinfo > /dev/null && sinfo -h > /dev/null 2>&1; then
    say "a SLURM cluster answers already (sinfo works): nothing to start"
    return
  fi
  [[ ! -e "$STARTED" ]] || die "$STARTED exists: a cluster from an earlier start may still run; run 'bash scripts/slurm/local_cluster.sh stop' first"
  if [[ -e "$CONF" ]] && ! conf_is_ours; then
    die "$CONF exists and was not written by this script (another cluster's?); start that cluster, or move it aside"
  fi
  local t0=$SECONDS
  install_packages
  mkdir -p "$STATE_DIR"
  : > "$STARTED"
  if ! munge_answers; then
    [[ -f /etc/munge/munge.key ]] || { mungekey --create && chown munge:munge /etc/munge/munge.key; }  # Debian's makes one
    install -d -o munge -g munge -m 0755 /run/munge
    start_daemon munged /run/munge/munged.pid runuser -u munge -- munged
    munge_answers || die "munged started but munge -n | unmunge fails (/var/log/munge/munged.log)"
  fi
  write_conf
  start_daemon slurmctld "$STATE_DIR/slurmctld.pid" slurmctld
  start_daemon slurmd "$STATE_DIR/slurmd.pid" slurmd
  local state="" i
  for (( i = 0; i < START_TIMEOUT * 2; i++ )); do
    state="$(sinfo -h -N -o %T 2> /dev/null | head -n 1 || true)"
    [[ "$state" == idle ]] && break
    sleep 0.5
  done
  [[ "$state" == idle ]] || die "the node is '${state:-not answering}' after ${START_TIMEOUT}s (logs in $STATE_DIR/log)"
  say "up in $(( SECONDS - t0 )) s: $(sinfo -h -o '%P %D node(s) %c CPU(s) %T' | head -n 1); 'bash scripts/slurm/local_cluster.sh stop' stops it"
}

# stop_pid NAME PID: SIGTERM the process PID if it is still NAME, then wait for it (SIGKILL after 15 s).
stop_pid() {
  local name="$1" pid="$2" i
  [[ "$(cat "/proc/$pid/comm" 2> /dev/null)" == "$name" ]] || return 0
  kill "$pid" 2> /dev/null || return 0
  for (( i = 0; i < 150; i++ )); do [[ -e "/proc/$pid" ]] || return 0; sleep 0.1; done
  say "$name ($pid) still runs 15 s after SIGTERM: SIGKILL"
  kill -9 "$pid" 2> /dev/null || true
}

stop() {
  [[ -f "$STARTED" ]] || { say "nothing to stop ($STARTED not found)"; return; }
  local jobs="" name pid i
  pid="$(awk '$1 == "slurmctld" {print $2}' "$STARTED")"
  if [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2> /dev/null)" == slurmctld ]]; then
    jobs="$(squeue -h -o %A 2> /dev/null || true)"  # pending, running and completing jobs
  fi
  if [[ -n "$jobs" ]]; then
    say "cancelling the cluster's jobs: $(echo $jobs)"
    scancel --full $jobs || true
    for (( i = 0; i < 60; i++ )); do [[ -z "$(squeue -h -o %A)" ]] && break; sleep 0.5; done
  fi
  # in the reverse order of starting: slurmd, slurmctld, then munged
  while read -r name pid; do
    case "$name" in
      conf) conf_is_ours && rm -f "$CONF" ;;
      *) stop_pid "$name" "$pid" ;;
    esac
  done < <(tac "$STARTED")
  rm -rf "$STATE_DIR"
  say "stopped"
}

"$1"
