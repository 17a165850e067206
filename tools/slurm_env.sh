#!/usr/bin/env bash
# Installs what the real-Slurm tests (tests/launch/test_slurm_*.py) need: Debian's slurm-wlm (slurmctld, slurmd,
# sbatch, ...) and munge. Nothing is started or configured here: the tests write a one-host loopback configuration in
# a temporary directory and run their own daemons for the session. A no-op when the programs are there already.
# Without root (a developer machine) it says so in one line and leaves the Slurm tests to skip; under CI=true (CI
# runs as root on a fresh machine) a missing install is an error.
set -euo pipefail
need=(slurmctld slurmd sbatch scontrol scancel munged)
missing=()
for prog in "${need[@]}"; do
    command -v "$prog" >/dev/null 2>&1 || [[ -x "/usr/sbin/$prog" ]] || missing+=("$prog")
done
[[ ${#missing[@]} -gt 0 ]] || exit 0
if [[ "$(id -u)" != 0 ]]; then
    msg="slurm-env: ${missing[*]} not installed and not root: the real-Slurm tests will skip (as root: apt-get install -y slurm-wlm munge)"
    if [[ "${CI:-}" == true ]]; then echo "$msg" >&2; exit 1; fi
    echo "$msg"
    exit 0
fi
command -v apt-get >/dev/null 2>&1 || { echo "slurm-env: no apt-get: install Slurm and munge by hand (${missing[*]} missing)" >&2; exit 1; }
echo "slurm-env: installing slurm-wlm and munge (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
# A fresh machine's boot-time apt run (cloud-init, unattended upgrades) may hold dpkg's lock: wait for it.
apt-get -o DPkg::Lock::Timeout=600 update -q
apt-get -o DPkg::Lock::Timeout=600 install -y -q slurm-wlm munge
