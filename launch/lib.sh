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

# gloo_ifname NCCL_SOCKET_IFNAME: print the interface of this node that gloo should use for
# NCCL's interface setting, or nothing when gloo should choose its own (the address of the host
# name). NCCL takes a list of name prefixes ("ib": the first interface whose name starts so),
# exact names ("=ib0") and exclusions ("^lo,docker0"); gloo takes one exact name, of an
# interface that exists. An exclusion, or a name that no interface of this node has, leaves the
# choice to gloo.
gloo_ifname() {
  local form=$1 exact="" want path name
  local -a wants
  case $form in
    '' | ^*) return 0 ;;
    =*) exact=1 form=${form#=} ;;
  esac
  IFS=, read -ra wants <<<"$form"
  for want in "${wants[@]}"; do
    [ -n "$want" ] || continue
    for path in /sys/class/net/*; do  # this node's interfaces, sorted
      name=${path##*/}
      if [ "$name" = "$want" ] || { [ -z "$exact" ] && [[ $name == "$want"* ]]; }; then
        echo "$name"
        return 0
      fi
    done
  done
}
