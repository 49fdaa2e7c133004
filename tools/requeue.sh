#!/usr/bin/env bash
# Run a deepspeed command so that a preemption ends it with exit code 75 and, under SLURM, requeues the job.
#
#   #SBATCH --requeue --signal=B:USR1@180     # B: signal this script only, 180 s before the time limit
#   tools/requeue.sh deepspeed train.py --output_dir runs/x ...
#
# SIGTERM or SIGUSR1 to this script is passed on as SIGUSR1 to the ranks alone (the processes whose
# command line holds --local_rank): each finishes its step, writes a checkpoint and exits 75, which
# DeepSpeed's launcher passes on. A signal to DeepSpeed's launcher itself would make it exit 1 at once
# (deepspeed/launcher/launch.py) and SIGKILL the ranks 30 s later. Exit 75 with SLURM_JOB_ID set runs
# `scontrol requeue`; the requeued job runs the same line and resumes (--resume auto). Without SLURM,
# a loop does the requeue:  while tools/requeue.sh deepspeed train.py ...; [ $? = 75 ]; do :; done
set -u
"$@" &
child=$!

ranks() {   # the descendants of $1 that are training ranks
    local c
    for c in $(pgrep -P "$1"); do
        case "$(tr '\0' ' ' < "/proc/$c/cmdline" 2>/dev/null)" in *--local_rank*) echo "$c" ;; esac
        ranks "$c"
    done
}
preempt() {
    echo "[requeue.sh] $1: SIGUSR1 to the ranks ($(ranks "$child" | xargs)); waiting for their checkpoint" >&2
    ranks "$child" | xargs -r kill -USR1
}
trap 'preempt SIGTERM' TERM
trap 'preempt SIGUSR1' USR1

while kill -0 "$child" 2>/dev/null; do wait "$child"; done   # a trapped signal ends a wait early
wait "$child"   # bash keeps an exited job's status: this is the command's own exit code
rc=$?
if [ "$rc" = 75 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    echo "[requeue.sh] exit 75: scontrol requeue $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
