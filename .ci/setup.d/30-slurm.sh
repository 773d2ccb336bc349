#!/usr/bin/env bash
# The Slurm tests' daemons: Debian's slurm-wlm (slurmctld, slurmd, client) and munge from apt, if
# missing. The tests start their own munged/slurmctld/slurmd under /var/tmp (no systemd needed).
# Never fails the suite: where this cannot be done the slurm tests skip with the reason, loudly.
set -uo pipefail

warn() { echo "WARNING: 30-slurm: $* (the slurm tests will be SKIPPED)" >&2; exit 0; }

need=()
for tool in slurmctld slurmd munged; do
    command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || need=(slurm-wlm munge)
done
command -v sbatch >/dev/null || need+=(slurm-client)
command -v runuser >/dev/null || need+=(util-linux)
if [ "${#need[@]}" -eq 0 ]; then
    echo "30-slurm: slurm-wlm and munge present"
    exit 0
fi
[ "$(id -u)" = 0 ] || warn "missing ${need[*]} and not root to apt-get install them"
command -v apt-get >/dev/null || warn "missing ${need[*]} and no apt-get"
echo "30-slurm: apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
for attempt in 1 2 3; do  # apt may be locked for a moment by another installer
    if { apt-get update -q && apt-get install -y -q --no-install-recommends "${need[@]}"; } >/tmp/30-slurm-apt.log 2>&1; then
        echo "30-slurm: installed ${need[*]}"
        exit 0
    fi
    sleep $((attempt * 10))
done
tail -20 /tmp/30-slurm-apt.log >&2
warn "apt-get install ${need[*]} failed"
