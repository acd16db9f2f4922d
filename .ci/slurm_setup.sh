#!/usr/bin/env bash
# Install Debian's SLURM (22.05: slurmctld, slurmd and the client commands) for the SLURM
# integration test. It installs programs only: no daemon is started or enabled here; the
# tests start a one-node cluster of their own in a temporary folder
# (python -m eyas.slurm.local_cluster start DIR) and stop it by PID.
set -euo pipefail
if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then
    if command -v sbatch >/dev/null 2>&1 && { command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ]; }; then
        echo "slurm_setup: SLURM already installed ($(/usr/sbin/slurmctld -V 2>/dev/null || true))"
        exit 0
    fi
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client
# The Debian packages may start their own daemons under an init system; the tests use
# their own config (SLURM_CONF) and ports, so those are left alone.
echo "slurm_setup: installed $(/usr/sbin/slurmctld -V 2>/dev/null || true)"
