#!/usr/bin/env bash
# A real single-node Slurm (slurmctld + slurmd from Debian's slurm-wlm) for hpcpipe's tests.
#
#   tests/jobs/local_slurm.sh install   # apt-get install slurmd slurmctld slurm-client (needs root)
#   tests/jobs/local_slurm.sh start     # write a config under $HPCPIPE_SLURM_DIR, start both daemons
#   tests/jobs/local_slurm.sh stop      # stop the daemons this script started
#
# The node declares HPCPIPE_SLURM_CPUS CPUs (default 8) whatever the hardware has
# (SlurmdParameters=config_overrides), so an 8-task job runs on a 2-core machine; auth/none,
# proctrack/linuxproc and task/none need neither munge nor cgroups. Exit status 3 from `install`
# or `start` means Slurm cannot run here (the tests skip with the printed reason).
set -euo pipefail
D=${HPCPIPE_SLURM_DIR:-/tmp/hpcpipe-slurm}
CPUS=${HPCPIPE_SLURM_CPUS:-8}
NODE=$(hostname -s)

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "cannot install slurm-wlm: needs root and apt-get" >&2; exit 3
    fi
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq slurmd slurmctld slurm-client; } >"${TMPDIR:-/tmp}/hpcpipe-slurm-apt.log" 2>&1 \
        || { echo "apt-get install slurmd slurmctld slurm-client failed (see ${TMPDIR:-/tmp}/hpcpipe-slurm-apt.log)" >&2; exit 3; }
}

start() {
    command -v slurmctld >/dev/null || { echo "slurmctld is not installed" >&2; exit 3; }
    stop >/dev/null 2>&1 || true
    mkdir -p "$D/state" "$D/spool" "$D/log"
    cat >"$D/slurm.conf" <<CONF
ClusterName=hpcpipe
SlurmctldHost=$NODE
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${HPCPIPE_SLURMCTLD_PORT:-16817}
SlurmdPort=${HPCPIPE_SLURMD_PORT:-16818}
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
KillWait=10
MinJobAge=600
NodeName=$NODE CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
    export SLURM_CONF="$D/slurm.conf"
    slurmctld -f "$SLURM_CONF" || { echo "slurmctld did not start (see $D/log/slurmctld.log)" >&2; exit 3; }
    slurmd -f "$SLURM_CONF" || { echo "slurmd did not start (see $D/log/slurmd.log)" >&2; exit 3; }
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
            echo "$SLURM_CONF"; return 0
        fi
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
        sleep 1
    done
    echo "the local Slurm node never became idle: $(sinfo -h -o '%T %E' 2>&1)" >&2; exit 3
}

stop() {
    for daemon in slurmd slurmctld; do
        # the daemons delete their pid files as they exit: read each pid once
        pid=$(cat "$D/$daemon.pid" 2>/dev/null || true)
        [ -n "$pid" ] || continue
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$D/$daemon.pid"
    done
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
