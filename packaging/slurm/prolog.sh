#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/shardcache/slurm/prolog.sh, run by slurmd as root
# on every node of a job): registers the job's prefetch manifest with this node's
# shardcached and waits, within bounds, until the data the job reads first is cached.
#
# A job names its manifest in its comment or its extra field:
#   sbatch --comment "shardcache=/lustre/proj/run7/manifest.json" train.sh
#   sbatch --extra   "shardcache=/lustre/proj/run7/manifests/%N.json" train.sh
# %N is this node's name (SLURMD_NODENAME), for plans whose ranks differ per node; %j is
# the job id. The manifest is read as the job's user, never as root.
#
# Always exits 0: a missing, unreadable or invalid manifest, a daemon that is down, or a
# wait that runs out is logged and the job starts anyway (it then reads the shared file
# system directly). README.md has the details.
set -u
here=$(dirname "$(readlink -f "$0")")
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$here/common.sh"

# The manifest named by the job, if any: the first shardcache=PATH token.
manifest=""
for field in "${SLURM_JOB_COMMENT:-}" "${SLURM_JOB_EXTRA:-}"; do
    for token in $field; do
        case "$token" in
            shardcache=?*) manifest=${token#shardcache=}; break 2 ;;
        esac
    done
done
[ -n "$manifest" ] || exit 0

node=${SLURMD_NODENAME:-$(hostname -s)}
manifest=${manifest//%N/$node}
manifest=${manifest//%j/$SLURM_JOB_ID}
case "$manifest" in
    /*) ;;
    *) shardcache_log "manifest $manifest: not an absolute path; not registered"; exit 0 ;;
esac

job=$(shardcache_job_id)
cmd=("$SHARDCACHE_CLI" prefetch "$manifest" --job "$job")
if [ "$SHARDCACHE_WAIT" != 0 ]; then
    cmd+=(--wait "$SHARDCACHE_WAIT" --timeout "$SHARDCACHE_TIMEOUT")
fi
# As the job's user: the manifest is read with the user's rights, and the daemon sees
# the user's credentials.
if [ "$(id -u)" = 0 ] && [ -n "${SLURM_JOB_UID:-}" ] && [ "$SLURM_JOB_UID" != 0 ]; then
    gid=${SLURM_JOB_GID:-$(id -g "$SLURM_JOB_UID" 2>/dev/null)}
    if [ -z "$gid" ]; then
        shardcache_log "no group for uid $SLURM_JOB_UID; not registered"
        exit 0
    fi
    cmd=(setpriv --reuid="$SLURM_JOB_UID" --regid="$gid" --init-groups -- "${cmd[@]}")
fi

# A hung daemon must not hold the job: the CLI's own timeout, plus a margin.
started=$SECONDS
if out=$(timeout --kill-after=5 "$((SHARDCACHE_TIMEOUT + 15))" "${cmd[@]}" 2>&1 </dev/null); then
    shardcache_log "registered $manifest as $job; ready after $((SECONDS - started)) s"
else
    shardcache_log "starting without the cache being ready ($manifest as $job): $(printf '%s' "$out" | tr '\r\n' '  ' | tail -c 400)"
fi
exit 0
