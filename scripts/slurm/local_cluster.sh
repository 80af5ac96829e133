#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine, to run the SLURM scripts (and their tests) under a real SLURM,
# multi-node jobs and a lost node included. As root on Debian or Ubuntu:
#   bash scripts/slurm/local_cluster.sh start             # install, configure, start; returns once the nodes are idle
#   bash scripts/slurm/local_cluster.sh stop              # cancel its jobs, stop and remove everything start made
#   bash scripts/slurm/local_cluster.sh kill-node NODE    # SIGKILL every process on NODE: a machine that dies
#   bash scripts/slurm/local_cluster.sh start-node NODE   # start NODE's slurmd again: the machine is back
# Each node (tnn-node1, tnn-node2, ...) is a network namespace of its own, with its own hostname (a UTS
# namespace) and a private address SUBNET.<i> on a veth pair whose other end is on a bridge, tnn-br (SUBNET.254,
# this machine's side), where slurmctld listens; the nodes resolve each other's names from STATE_DIR/hosts,
# bound over /etc/hosts in their mount namespace. Nothing outside this machine is addressed. One slurmd runs in
# each node, one slurmctld and munged on the machine; a job's processes run in their node's namespaces, so a
# two-node job talks from one node's address to the other's, as on two machines.
# start installs Debian's slurm-wlm and munge if missing (apt-get, after apt-get update when its package lists
# are empty or the install fails without one), writes /etc/slurm/slurm.conf (each node as `slurmd -C` sees
# this machine: its real CPU count; one partition, `local`; no GPUs, no accounting), starts munged (unless one
# answers already), creates the bridge and the nodes, starts slurmctld and the slurmds, and waits until `sinfo`
# shows every node idle. Then submit as on any cluster, e.g. CPU=1 DATA=data-bin/sample sbatch --nodes=2 \
# --gpus-per-node=0 --ntasks-per-node=1 --cpus-per-task=1 scripts/slurm/train.sbatch tnn_lm_tiny
# (docs/training.md#several-machines). Timeouts are short, for tests: a requeued job restarts after about 10 s
# (AuthInfo=cred_expire=10; SLURM's default is 2 minutes), and a node whose slurmd stops answering is marked
# down after SLURMD_TIMEOUT seconds (SLURM's default is 300), its jobs requeued.
# stop cancels the cluster's jobs, stops the daemons start started (their process ids are in STATE_DIR/started)
# and whatever still runs on the nodes, removes the nodes' namespaces and links, the bridge, the slurm.conf
# start wrote and STATE_DIR; the packages stay installed.
# start refuses an /etc/slurm/slurm.conf it did not write (another cluster's) and does nothing when a
# cluster answers already (sinfo works): stop then has nothing to stop.
# Knobs (environment variables, defaults in brackets): STATE_DIR [/tmp/fairseq-tnn-slurm]: the daemons' state,
# spool, logs and process ids; START_TIMEOUT [60]: seconds to wait for the nodes to be idle; NODES [2]: the
# number of nodes (1 to 9); SUBNET [10.241.41]: the private /24 network of the nodes, its first three numbers
# (refused if this machine has an address or route in it); SLURMD_TIMEOUT [10]: seconds before an unanswering
# node is marked down.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../lib.sh
source "$ROOT/scripts/lib.sh"
usage="usage: bash scripts/slurm/local_cluster.sh start|stop|kill-node NODE|start-node NODE   (as root; settings are environment variables)"
case "${1:-} $#" in
  "start 1"|"stop 1"|"kill-node 2"|"start-node 2") ;;
  *) usage_error ;;
esac
STATE_DIR="${STATE_DIR:-/tmp/fairseq-tnn-slurm}"
START_TIMEOUT="${START_TIMEOUT:-60}"
NODES="${NODES:-2}"
SUBNET="${SUBNET:-10.241.41}"
SLURMD_TIMEOUT="${SLURMD_TIMEOUT:-10}"
is_pos_int "$START_TIMEOUT" || die "START_TIMEOUT must be a whole number of seconds, not '$START_TIMEOUT'" 2
[[ "$NODES" =~ ^[1-9]$ ]] || die "NODES must be a number of nodes from 1 to 9, not '$NODES'" 2
[[ "$SUBNET" =~ ^(10\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])|172\.(1[6-9]|2[0-9]|3[01])|192\.168)\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])$ ]] \
  || die "SUBNET must be the first three numbers of a private /24 network (10.a.b, 172.16-31.b or 192.168.b), not '$SUBNET'" 2
is_pos_int "$SLURMD_TIMEOUT" && (( SLURMD_TIMEOUT >= 3 )) \
  || die "SLURMD_TIMEOUT must be a whole number of seconds, at least 3, not '$SLURMD_TIMEOUT'" 2
CONF=/etc/slurm/slurm.conf
MARK="# written by fairseq-tnn scripts/slurm/local_cluster.sh"
STARTED="$STATE_DIR/started"  # what start made, one line each: "<daemon> <pid>", "conf", "link <name>", "netns <name>"
BRIDGE=tnn-br
HOSTS="$STATE_DIR/hosts"

conf_is_ours() { [[ "$(head -c ${#MARK} "$CONF" 2> /dev/null)" == "$MARK" ]]; }

munge_answers() { command -v munge > /dev/null && munge -n 2> /dev/null | unmunge > /dev/null 2>&1; }

install_packages() {
  local missing=() cmd
  for cmd in munged slurmctld slurmd sbatch; do command -v "$cmd" > /dev/null || missing+=("$cmd"); done
  (( ${#missing[@]} == 0 )) && return
  command -v apt-get > /dev/null || die "${missing[*]} not found and no apt-get: install SLURM (slurm-wlm) and munge yourself"
  say "installing slurm-wlm and munge (missing: ${missing[*]})"
  local install=(apt-get install -y -q --no-install-recommends slurm-wlm munge)
  if ! compgen -G "/var/lib/apt/lists/*_Packages*" > /dev/null || ! DEBIAN_FRONTEND=noninteractive "${install[@]}"; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${install[@]}"
  fi
}

# The network: the bridge with this machine's address, and per node a namespace and a veth pair (eth0 inside).
make_network() {
  local i node
  ip link add "$BRIDGE" type bridge
  echo "link $BRIDGE" >> "$STARTED"
  ip addr add "$SUBNET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for (( i = 1; i <= NODES; i++ )); do
    node="tnn-node$i"
    ip netns add "$node"
    echo "netns $node" >> "$STARTED"
    ip link add "$node" type veth peer name eth0 netns "$node"
    echo "link $node" >> "$STARTED"
    ip link set "$node" master "$BRIDGE" up
    ip -n "$node" addr add "$SUBNET.$i/24" dev eth0
    ip -n "$node" link set eth0 up
    ip -n "$node" link set lo up
  done
}

write_conf() {
  local desc host i
  desc="$(slurmd -C | head -n 1)"  # NodeName=<host> CPUs=... Boards=... RealMemory=...: what each slurmd will find
  [[ "$desc" == NodeName=* ]] || die "slurmd -C did not describe this machine: '$desc'"
  host="${desc%% *}"; host="${host#NodeName=}"
  desc="${desc#* }"
  mkdir -p /etc/slurm "$STATE_DIR/ctld" "$STATE_DIR/log"
  { echo "127.0.0.1 localhost"; echo "$SUBNET.254 $host"
    for (( i = 1; i <= NODES; i++ )); do echo "$SUBNET.$i tnn-node$i"; done; } > "$HOSTS"
  {
    cat <<EOT
$MARK (STATE_DIR=$STATE_DIR); 'local_cluster.sh stop' removes it
ClusterName=fairseq-tnn-local
SlurmctldHost=$host($SUBNET.254)
EOT
    for (( i = 1; i <= NODES; i++ )); do echo "NodeName=tnn-node$i NodeAddr=$SUBNET.$i $desc State=UNKNOWN"; done
    cat <<EOT
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
SlurmUser=root
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d-%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
SlurmdTimeout=$SLURMD_TIMEOUT
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
EOT
  } > "$CONF"
  echo conf >> "$STARTED"
}

# start_daemon NAME PIDFILE COMMAND...: run a daemon that writes PIDFILE; record its pid in STARTED.
start_daemon() {
  local name="$1" pidfile="$2" i
  shift 2
  rm -f "$pidfile"
  "$@" || die "$name did not start (its log: $STATE_DIR/log/ or /var/log/munge/munged.log)"
  for (( i = 0; i < 100; i++ )); do [[ -s "$pidfile" ]] && break; sleep 0.1; done
  [[ -s "$pidfile" ]] || die "$name wrote no process id to $pidfile"
  echo "$name $(cat "$pidfile")" >> "$STARTED"
}

# start_slurmd NODE: slurmd in NODE's network namespace, with a UTS and a mount namespace of its own (the
# hostname NODE, HOSTS as /etc/hosts); it finds its node name from the hostname.
start_slurmd() {
  local node="$1"
  # shellcheck disable=SC2016  # expanded by the inner bash
  mkdir -p "$STATE_DIR/d-$node"
  # nsenter rather than `ip netns exec`, which mounts a /sys of its own, without the cgroup file system slurmd reads
  start_daemon slurmd "$STATE_DIR/slurmd-$node.pid" nsenter --net="/run/netns/$node" unshare --uts --mount \
    bash -c 'mount --bind "$1" /etc/hosts && hostname "$2" && exec slurmd' slurmd "$HOSTS" "$node"
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
  local used i
  used="$(ip -4 -o addr show | awk -v s="$SUBNET." 'index($4, s) == 1 {print $2 " " $4}')$(ip -4 route show | awk -v s="$SUBNET." 'index($1, s) == 1')"
  [[ -z "$used" ]] || die "SUBNET=$SUBNET is in use on this machine ($(echo $used)): choose another private /24 (SUBNET=10.a.b)" 2
  for (( i = 1; i <= NODES; i++ )); do
    ! ip netns list | grep -qw "tnn-node$i" || die "a network namespace tnn-node$i exists already (ip netns list): not ours; remove it first"
  done
  ! ip link show "$BRIDGE" > /dev/null 2>&1 || die "a network link $BRIDGE exists already (ip link): not ours; remove it first"
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
  make_network
  start_daemon slurmctld "$STATE_DIR/slurmctld.pid" slurmctld
  for (( i = 1; i <= NODES; i++ )); do start_slurmd "tnn-node$i"; done
  local idle=0
  for (( i = 0; i < START_TIMEOUT * 4; i++ )); do
    idle="$(sinfo -h -N -t idle -o %N 2> /dev/null | sort -u | wc -l || true)"
    (( idle == NODES )) && break
    sleep 0.25
  done
  (( idle == NODES )) || die "$idle of $NODES node(s) idle after ${START_TIMEOUT}s: $(sinfo -h -N -o '%N %T' 2> /dev/null | sort -u | tr '\n' ' ')(logs in $STATE_DIR/log)"
  say "up in $(( SECONDS - t0 )) s: $(sinfo -h -o '%P %D node(s) %N, %c CPU(s) each, %T' | head -n 1); 'bash scripts/slurm/local_cluster.sh stop' stops it"
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

# kill_on NODE SIGNAL: send SIGNAL to every process in NODE's network namespace and wait (up to 15 s) until none
# is left; what still runs then is named.
kill_on() {
  local node="$1" signal="$2" pids i
  for (( i = 0; i < 150; i++ )); do
    pids="$(ip netns pids "$node" 2> /dev/null || true)"
    [[ -z "$pids" ]] && return 0
    # shellcheck disable=SC2086  # one pid a word
    (( i % 20 == 0 )) && kill "-$signal" $pids 2> /dev/null || true
    sleep 0.1
  done
  say "still running on $node after SIG$signal: $(echo $pids)"
}

stop() {
  [[ -f "$STARTED" ]] || { say "nothing to stop ($STARTED not found)"; return; }
  local jobs="" kind name i
  name="$(awk '$1 == "slurmctld" {print $2}' "$STARTED")"
  if [[ -n "$name" && "$(cat "/proc/$name/comm" 2> /dev/null)" == slurmctld ]]; then
    jobs="$(squeue -h -o %A 2> /dev/null || true)"  # pending, running and completing jobs
  fi
  if [[ -n "$jobs" ]]; then
    say "cancelling the cluster's jobs: $(echo $jobs)"
    scancel --full $jobs || true
    for (( i = 0; i < 60; i++ )); do [[ -z "$(squeue -h -o %A 2> /dev/null)" ]] && break; sleep 0.5; done
  fi
  # in the reverse order of starting: the slurmds, slurmctld, the nodes (what still runs there, then their
  # links and namespaces), the bridge, the conf, munged
  while read -r kind name; do
    case "$kind" in
      conf) conf_is_ours && rm -f "$CONF" ;;
      link) ip link del "$name" 2> /dev/null || true ;;
      netns) kill_on "$name" TERM; kill_on "$name" KILL; ip netns del "$name" 2> /dev/null || true ;;
      *) stop_pid "$kind" "$name" ;;
    esac
  done < <(tac "$STARTED")
  rm -rf "$STATE_DIR"
  say "stopped"
}

# node_of NAME: NAME if it is one of the nodes start made, else an error naming them.
node_of() {
  local nodes
  [[ -f "$STARTED" ]] || die "no cluster of this script runs ($STARTED not found): 'bash scripts/slurm/local_cluster.sh start' first"
  nodes="$(awk '$1 == "netns" {print $2}' "$STARTED")"
  grep -qx -- "$1" <<< "$nodes" || die "NODE must be one of this cluster's nodes ($(echo $nodes)), not '$1'" 2
}

kill-node() {
  node_of "$1"
  say "$1: SIGKILL to its slurmd and every process of its jobs: $(echo $(ip netns pids "$1"))"
  kill_on "$1" KILL
}

start-node() {
  node_of "$1"
  [[ -z "$(ip netns pids "$1")" ]] || die "$1 runs already (processes $(echo $(ip netns pids "$1"))): 'kill-node $1' first" 2
  start_slurmd "$1"
  say "$1: slurmd started; the node returns to service once it has registered (ReturnToService=2)"
}

"$@"
