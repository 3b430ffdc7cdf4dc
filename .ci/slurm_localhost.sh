#!/usr/bin/env bash
# A real single-node Slurm on this machine (Debian's slurmctld + slurmd, munge), for running
# examples/launch/slurm.sh in tests (tests/examples/test_slurm_launch.py). As root, on a
# fresh Debian machine: installs the packages, writes a minimal slurm.conf whose one node is
# this host at 127.0.0.1 (every daemon and job stays on loopback), starts munged, slurmctld
# and slurmd, and waits until the node takes jobs. Idempotent: daemons already running are
# left as they are. No systemd needed (containers have none).
set -euo pipefail

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

HOST=$(hostname -s)
CPUS=${SLURM_TEST_CPUS:-8}   # logical CPUs Slurm may hand out (config_overrides: more than real)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=areal-test
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF

if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge && chmod 0600 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd

for _ in $(seq 60); do
    state=$(sinfo -h -N -o %T 2>/dev/null | head -1 || true)
    case "$state" in idle|mixed|allocated) echo "slurm on $HOST: node $state"; exit 0;; esac
    sleep 1
done
echo "slurm did not come up; node state: ${state:-none}" >&2
tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
