#!/usr/bin/env bash
# On the lent GPU machine: jobs that outlive one device call. A call runs at most 10 minutes
# and a machine left idle for 30 s is gone, so a session starts its test groups and benchmarks
# detached in one call and waits for them over the next ones, issued back to back.
#     bash scripts/gpu_jobs.sh start NAME SCRIPT [ARGS...]  # run `bash SCRIPT ARGS` detached
#     bash scripts/gpu_jobs.sh wait SECONDS                  # until every job ended, or SECONDS
# A job logs to /tmp/jobs/NAME.log and writes its exit status to /tmp/jobs/NAME.rc; its other
# output belongs under /tmp/jobs too. `wait` prints each job's state and log tail, then packs
# /tmp/jobs into $OUT/jobs.tgz, so every call brings back what the jobs have written so far.
# What is packed is kept small (a transfer of a large $OUT once failed): every *.log with its
# progress bars collapsed (what a line shows after its last \r), cut to its last $JOBS_LOG_LINES
# lines (400) after pytest's outcome lines from the whole log; any other file whole, unless it is
# over $JOBS_MAX_MIB MiB (8): those stay on the machine, listed in jobs/PACKED.txt.
set -uo pipefail
JOBS=/tmp/jobs
LOG_LINES=${JOBS_LOG_LINES:-400}
MAX_BYTES=$(( ${JOBS_MAX_MIB:-8} * 1048576 ))
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
  # The log written last under a job's folder (a chain's step, a test group), where it is not
  # the job's own log: what the job is doing now.
  local newest
  newest=$(find "$JOBS" -mindepth 2 -name '*.log' -mmin -2 -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -n 1 | cut -d' ' -f2-)
  if [ -n "$newest" ]; then
    echo "-- $newest:"
    tail -c 4000 "$newest" | tr '\r' '\n' | grep -v '^\s*$' | tail -n 3 | cut -c1-300
  fi
  pack
}

# A log as packed: the pytest outcome lines of the whole log (FAILED/ERROR/SKIPPED and the
# summary), then its last LOG_LINES lines, each line as it last showed (a progress bar's \r
# redraws collapsed).
packed_log() {
  local f=$1 lines
  lines=$(wc -l < "$f")
  if [ "$lines" -gt "$LOG_LINES" ]; then
    echo "[gpu_jobs.sh pack: $lines lines, $(stat -c %s "$f") bytes; the whole log stays on the machine as $f]"
    sed 's/\r$//; s/.*\r//' "$f" | grep -aE '^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)[ :]|^=+ .*(passed|failed|error|skipped|no tests ran).* =+$' | head -n 200
    echo "[... the last $LOG_LINES lines:]"
  fi
  tail -n "$LOG_LINES" "$f" | sed 's/\r$//; s/.*\r//'
}

pack() {
  local stage rel size
  stage=$(mktemp -d)
  mkdir -p "$stage/jobs"
  : > "$stage/jobs/PACKED.txt"
  while IFS= read -r -d '' rel; do
    mkdir -p "$stage/$(dirname "$rel")"
    size=$(stat -c %s "/tmp/$rel" 2>/dev/null || echo 0)
    case $rel in
      *.log) packed_log "/tmp/$rel" > "$stage/$rel"
        echo "$rel $size bytes, packed as its outcome lines and tail" >> "$stage/jobs/PACKED.txt" ;;
      *) if [ "$size" -gt "$MAX_BYTES" ]; then
           echo "$rel $size bytes, LEFT ON THE MACHINE (over ${JOBS_MAX_MIB:-8} MiB)" >> "$stage/jobs/PACKED.txt"
         else
           cp "/tmp/$rel" "$stage/$rel" 2>/dev/null
         fi ;;
    esac
  done < <(cd /tmp && find jobs -type f ! -name '*.pid' -print0)
  tar -czf "${OUT:?set OUT to the output folder of the device call}/jobs.tgz" -C "$stage" jobs
  rm -rf "$stage"
  size=$(stat -c %s "$OUT/jobs.tgz")
  echo "packed $OUT/jobs.tgz: $((size / 1024)) KiB"
  [ "$size" -lt $((15 * 1048576)) ] || echo "WARNING: jobs.tgz is over 15 MiB (16 MiB a file come back): lower JOBS_LOG_LINES or JOBS_MAX_MIB" >&2
}

usage() { echo "usage: gpu_jobs.sh start NAME SCRIPT [ARGS...] | wait SECONDS" >&2; exit 2; }

case "${1:-}" in
  start) [ $# -ge 3 ] || usage; shift; start "$@" ;;
  wait) [ $# -eq 2 ] || usage; wait_jobs "$2" ;;
  *) usage ;;
esac
