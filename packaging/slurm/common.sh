# Shared by prolog.sh and epilog.sh (sourced; not run on its own). The cache is an
# optimization: nothing here may fail or hold up a job beyond the configured wait.

# Site settings: /etc/shardcache/slurm.env (shell variable assignments) or the
# environment of slurmd.
SHARDCACHE_SLURM_ENV=${SHARDCACHE_SLURM_ENV:-/etc/shardcache/slurm.env}
# shellcheck source=/dev/null
[ -r "$SHARDCACHE_SLURM_ENV" ] && . "$SHARDCACHE_SLURM_ENV"
SHARDCACHE_CLI=${SHARDCACHE_CLI:-/usr/bin/shardcache}
SHARDCACHE_SOCKET=${SHARDCACHE_SOCKET:-/run/shardcache/shardcached.sock}
# Wait until this fraction of the job's first readiness window is cached (0 = only
# register), for at most SHARDCACHE_TIMEOUT seconds.
SHARDCACHE_WAIT=${SHARDCACHE_WAIT:-0.5}
SHARDCACHE_TIMEOUT=${SHARDCACHE_TIMEOUT:-120}
# 1: log to syslog (tag shardcache-slurm) as well as to stderr.
SHARDCACHE_SYSLOG=${SHARDCACHE_SYSLOG:-1}
export SHARDCACHE_SOCKET
# Prologs and epilogs run without a search path.
PATH=/usr/sbin:/usr/bin:/sbin:/bin

# The id the job is registered under on this node.
shardcache_job_id() {
    printf 'slurm-%s' "$SLURM_JOB_ID"
}

# Logs one line to syslog (slurmd discards a prolog's output) and to stderr.
shardcache_log() {
    if [ "$SHARDCACHE_SYSLOG" = 1 ] && command -v logger >/dev/null 2>&1; then
        logger -t "shardcache-slurm" -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true
    fi
    printf 'shardcache-slurm: job %s: %s\n' "${SLURM_JOB_ID:-?}" "$*" >&2
}

case "${SLURM_JOB_ID:-}" in
    '' | *[!0-9_]*)
        shardcache_log "SLURM_JOB_ID is '${SLURM_JOB_ID:-}', not a job id: nothing to do"
        exit 0
        ;;
esac
