#!/bin/bash
# Shared by launch/job.sh and launch/node.sh (sourced, not run).

# wait_for PID: wait until the background process PID has ended; return its exit code.
# Both scripts start their child in the background and wait for it, because bash runs a trap
# only between commands. `wait` also returns early (>128) when a trapped signal arrives; the
# child is still running then, so wait again.
wait_for() {
  local rc
  while :; do
    wait "$1" && rc=0 || rc=$?
    if ! kill -0 "$1" 2>/dev/null; then return "$rc"; fi
  done
}
