#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/shardcache/slurm/epilog.sh, run by slurmd as root
# on every node of a job when it ends): forgets the job's plan on this node, so the
# cache stops keeping and prefetching its data for it.
#
# Always exits 0: a failing epilog drains the node, and a plan left behind only steers
# the cache until an operator runs `shardcache unregister slurm-<jobid>` or the daemon
# restarts (registrations live in its memory).
set -u
here=$(dirname "$(readlink -f "$0")")
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$here/common.sh"

job=$(shardcache_job_id)
if out=$(timeout --kill-after=5 30 "$SHARDCACHE_CLI" unregister "$job" 2>&1 </dev/null); then
    shardcache_log "unregistered $job"
else
    case "$out" in
        *"is registered"*) ;; # the job named no manifest (or its registration failed)
        *) shardcache_log "could not unregister $job: $(printf '%s' "$out" | tr '\r\n' '  ' | tail -c 400)" ;;
    esac
fi
exit 0
