#!/usr/bin/env bash
# On the lent GPU machine: jobs that outlive one device call. A call runs at most 10 minutes
# and a machine left idle for 30 s is gone, so a session starts its test groups and benchmarks
# detached in one call and waits for them over the next ones, issued back to back.
#     bash scripts/gpu_jobs.sh start NAME SCRIPT [ARGS...]  # run `bash SCRIPT ARGS` detached
#     bash scripts/gpu_jobs.sh wait SECONDS                  # until every job ended, or SECONDS
# A job logs to /tmp/jobs/NAME.log and writes its exit status to /tmp/jobs/NAME.rc; its other
# output belongs under /tmp/jobs too. `wait` prints each job's state and log tail, then packs
# /tmp/jobs into $OUT/jobs.tgz, so every call brings back what the jobs have written so far.
set -uo pipefail
JOBS=/tmp/jobs
mkdir -p "$JOBS"

start() {
  local name=$1 script=$2
  shift 2
  if [ -f "$JOBS/$name.pid" ] && kill -0 "$(cat "$JOBS/$name.pid")" 2>/dev/null; then
    echo "job $name is still running (pid $(cat "$JOBS/$name.pid"))" >&2
    return 1
  fi
  rm -f "$JOBS/$name.pid" "$JOBS/$name.rc"
  # shellcheck disable=SC2016  # $$ and $? belong to the detached shell
  setsid nohup bash -c 'echo $$ > "$0.pid"; bash "$@"; echo $? > "$0.rc"' \
    "$JOBS/$name" "$script" "$@" > "$JOBS/$name.log" 2>&1 < /dev/null &
  for _ in $(seq 50); do [ -f "$JOBS/$name.pid" ] && break; sleep 0.1; done
  echo "started $name (pid $(cat "$JOBS/$name.pid"))"
}

running() {
  local pid
  for pid in "$JOBS"/*.pid; do
    [ -f "$pid" ] && kill -0 "$(cat "$pid")" 2>/dev/null && return 0
  done
  return 1
}

wait_jobs() {
  local limit=$1 begin=$SECONDS pid name
  while running && [ $((SECONDS - begin)) -lt "$limit" ]; do sleep 5; done
  for pid in "$JOBS"/*.pid; do
    [ -f "$pid" ] || continue
    name=$(basename "$pid" .pid)
    if kill -0 "$(cat "$pid")" 2>/dev/null; then
      echo "$name: running"
    else
      echo "$name: ended, rc=$(cat "$JOBS/$name.rc" 2>/dev/null || echo '?')"
    fi
    tail -n 4 "$JOBS/$name.log" | tr '\r' '\n' | tail -n 4
  done
  # Logs grow while they are packed: tar says so with status 1, which is no failure here.
  tar -czf "${OUT:?set OUT to the output folder of the device call}/jobs.tgz" -C /tmp \
    --warning=no-file-changed --exclude='*.pid' jobs || [ $? -eq 1 ]
}

usage() { echo "usage: gpu_jobs.sh start NAME SCRIPT [ARGS...] | wait SECONDS" >&2; exit 2; }

case "${1:-}" in
  start) [ $# -ge 3 ] || usage; shift; start "$@" ;;
  wait) [ $# -eq 2 ] || usage; wait_jobs "$2" ;;
  *) usage ;;
esac
