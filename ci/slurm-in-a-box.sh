#!/usr/bin/env bash
# Slurm in a box: a real two-node Slurm cluster on this machine (Linux, root), to run ci/nightly.sbatch as
# users submit it.
#
#   sudo ci/slurm-in-a-box.sh [COMMAND ...]
#
# Brings the cluster up, runs COMMAND on the login node (node0; default: sinfo), tears everything down and
# exits with COMMAND's status. For example, the nightly job on CPU ranks:
#
#   sudo ci/slurm-in-a-box.sh sbatch --wait --export=ALL,GPUS_PER_NODE=1,BENCH=0,SUITE=ci/box,BASELINES=ci/box/baselines ci/nightly.sbatch
#
# What it makes (all of it removed on exit, on failure and on Ctrl-C too):
#   * slurmctld, slurmd and the munge client from Debian (slurmctld slurmd slurm-client munge), installed
#     if missing;
#   * two "nodes", node0 and node1: network namespaces joined by a veth pair (10.233.N.1 and .2), each
#     process of a node also in its own UTS namespace (its host name) and mount namespace (an /etc/hosts
#     naming both nodes, bind-mounted: the host's own is not touched);
#   * munged (its socket in the box), slurmctld on node0, one slurmd per node, from a generated slurm.conf;
#   * it waits until sinfo shows both nodes idle.
# Exit status: COMMAND's; 2 not root; 3 a tool missing or Slurm not installable; 4 the cluster did not come up.
# The host's network configuration is not touched beyond the veth pair. A daemon that does not come up is
# named with the last lines of its log. Nothing is left running: the daemons are killed and the namespaces
# deleted, whatever happened.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "slurm-in-a-box: needs root (network namespaces, daemons)" >&2
  exit 2
fi
for tool in ip unshare nsenter bc; do
  command -v "$tool" >/dev/null \
    || { echo "slurm-in-a-box: needs $tool (iproute2, util-linux, bc)" >&2; exit 3; }
done
missing=()
for tool in slurmctld slurmd sbatch munged; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" != 0 ]; then
  echo "slurm-in-a-box: installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})" >&2
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1; then
    apt-get update >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
      || { echo "slurm-in-a-box: cannot install Slurm (apt-get install slurmctld slurmd slurm-client munge failed)" >&2; exit 3; }
  fi
fi

started=$(date +%s.%N)
BOX=$(mktemp -d /tmp/slurm-box.XXXXXX)
chmod 755 "$BOX"
TAG="cgs$(( $$ % 100000 ))"
SUBNET=$(( 16 + $$ % 200 ))
NS=("${TAG}n0" "${TAG}n1")
DEV=("${TAG}v0" "${TAG}v1")
ADDR=("10.233.$SUBNET.1" "10.233.$SUBNET.2")
NODES=(node0 node1)
CPUS=$(nproc)
export SLURM_CONF="$BOX/slurm.conf"

gone() {  # wait, at most 10 s, until the processes $@ have exited (zombies count as exited): a killed process
  # can take a while to go on a loaded machine, and the box is torn down only once its daemons are gone
  local pid i
  for pid in "$@"; do
    for i in $(seq 200); do
      [ -e "/proc/$pid" ] || break
      [ "$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)" = Z ] && break
      sleep 0.05
    done
  done
}

teardown() {
  local status=$?
  trap - EXIT INT TERM
  local killed=()
  for pidfile in "$BOX"/slurmd-node*.pid "$BOX"/slurmctld.pid "$BOX"/munged.pid; do
    [ -f "$pidfile" ] && killed+=("$(cat "$pidfile")") && kill "${killed[-1]}" 2>/dev/null || true
  done
  for ns in "${NS[@]}"; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null && killed+=($pids) || true
    ip netns del "$ns" 2>/dev/null || true
  done
  [ -f "$BOX/munged.pid" ] && kill -9 "$(cat "$BOX/munged.pid")" 2>/dev/null || true
  gone "${killed[@]}"
  if [ "${KEEP_BOX:-0}" = 1 ]; then echo "slurm-in-a-box: logs kept in $BOX" >&2; else rm -rf "$BOX"; fi
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {  # a daemon that did not come up: its name and its log's last lines
  echo "slurm-in-a-box: $1 did not come up; the last lines of $2:" >&2
  tail -n 5 "$2" >&2 2>/dev/null || echo "  (no log written)" >&2
  exit 4
}

# on NODE: run a command in node NODE's network, UTS and mount namespaces (its host name, its /etc/hosts)
on() {
  local k=$1
  shift
  nsenter --net="/run/netns/${NS[$k]}" unshare --uts --mount --propagation private \
    sh -c 'hostname "$0"; mount --bind "$1" /etc/hosts; shift; exec "$@"' "${NODES[$k]}" "$BOX/hosts" "$@"
}

# 1. The nodes: two namespaces joined by a veth pair.
for k in 0 1; do ip netns add "${NS[$k]}"; done
ip link add "${DEV[0]}" type veth peer name "${DEV[1]}"
for k in 0 1; do
  ip link set "${DEV[$k]}" netns "${NS[$k]}"
  ip -n "${NS[$k]}" addr add "${ADDR[$k]}/24" dev "${DEV[$k]}"
  ip -n "${NS[$k]}" link set "${DEV[$k]}" up
  ip -n "${NS[$k]}" link set lo up
done
{
  echo "127.0.0.1 localhost"
  for k in 0 1; do echo "${ADDR[$k]} ${NODES[$k]}"; done
} >"$BOX/hosts"

# 2. munge, with its socket in the box (every namespace sees the file system).
mkdir -p "$BOX/munge"
munged --force --socket="$BOX/munge/munge.socket.2" --key-file=/etc/munge/munge.key \
  --pid-file="$BOX/munged.pid" --log-file="$BOX/munged.log" --seed-file="$BOX/munge/seed" \
  || fail munged "$BOX/munged.log"

# 3. slurm.conf, slurmctld on node0, one slurmd per node.
mkdir -p "$BOX/state" "$BOX/spool-node0" "$BOX/spool-node1"
cat >"$SLURM_CONF" <<EOF
ClusterName=box
SlurmctldHost=node0(${ADDR[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$BOX/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation=$BOX/state
SlurmdSpoolDir=$BOX/spool-%n
SlurmctldPidFile=$BOX/slurmctld.pid
SlurmdPidFile=$BOX/slurmd-%n.pid
SlurmctldLogFile=$BOX/slurmctld.log
SlurmdLogFile=$BOX/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
NodeName=node0 NodeAddr=${ADDR[0]} CPUs=$CPUS State=UNKNOWN
NodeName=node1 NodeAddr=${ADDR[1]} CPUs=$CPUS State=UNKNOWN
PartitionName=box Nodes=node0,node1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
on 0 slurmctld -i || fail slurmctld "$BOX/slurmctld.log"
for k in 0 1; do on "$k" slurmd || fail "slurmd on ${NODES[$k]}" "$BOX/slurmd-${NODES[$k]}.log"; done

# 4. Wait until both nodes are idle.
for _ in $(seq 1 60); do
  states=$(on 0 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
  if [ "$(echo "$states" | grep -c ' idle$' || true)" = 2 ]; then break; fi
  sleep 0.5
done
if [ "$(echo "$states" | grep -c ' idle$' || true)" != 2 ]; then
  echo "slurm-in-a-box: the nodes are not idle (sinfo: ${states:-nothing})" >&2
  for log in "$BOX/slurmctld.log" "$BOX"/slurmd-node*.log; do fail "$(basename "$log" .log)" "$log" || true; done
  exit 4
fi
up=$(date +%s.%N)
echo "slurm-in-a-box: node0 and node1 idle, up in $(echo "$up - $started" | bc) s (SLURM_CONF=$SLURM_CONF)" >&2

# 5. The command, on the login node.
cmd=("$@")
[ "${#cmd[@]}" = 0 ] && cmd=(sinfo)
status=0
on 0 "${cmd[@]}" &  # waited on below, so that a signal tears the box down at once (the command with it)
wait $! || status=$?
echo "slurm-in-a-box: \`${cmd[*]}\` exited $status after $(echo "$(date +%s.%N) - $up" | bc) s" >&2
# What Slurm says of every job it ran: a job cancelled at its time limit is a timeout, whatever printed.
while read -r job; do
  [ -n "$job" ] || continue
  id=$(grep -o 'JobId=[^ ]*' <<<"$job" | cut -d= -f2)
  state=$(grep -o 'JobState=[^ ]*' <<<"$job" | cut -d= -f2)
  echo "slurm-in-a-box: job $id $(grep -o 'JobName=[^ ]*' <<<"$job" | cut -d= -f2): $state," \
    "exit $(grep -o ' ExitCode=[^ ]*' <<<"$job" | cut -d= -f2), nodes $(grep -o ' NodeList=[^ ]*' <<<"$job" | cut -d= -f2)" >&2
  if [ "$state" = TIMEOUT ]; then
    echo "slurm-in-a-box: job $id timed out: Slurm cancelled it at its time limit" >&2
    [ "$status" != 0 ] || status=124
  fi
done < <(on 0 scontrol show job -o 2>/dev/null | grep JobId= || true)
exit "$status"
