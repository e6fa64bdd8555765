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

# on_off NAME DEFAULT: print 1 or 0 for the switch in the variable NAME: 1, true, yes or on, and
# 0, false, no or off, in any case; unset or empty, DEFAULT. Anything else is one sentence and
# status 2: a CHECK_ONLY=true read as "not 1" ran the whole training instead of its preflight.
on_off() {
  local value=${!1:-$2}
  case ${value,,} in
    1 | true | yes | on) echo 1 ;;
    0 | false | no | off) echo 0 ;;
    *)
      echo "error: $1=$value is not a switch: give $1=1 (or yes) to turn it on, $1=0 (or no)" \
        "to turn it off, or unset it for its default, $2" >&2
      return 2
      ;;
  esac
}

# gloo_ifname NCCL_SOCKET_IFNAME: print the interface of this node that gloo should use for
# NCCL's interface setting, or nothing when gloo should choose its own (the address of the host
# name). NCCL takes a list of name prefixes ("ib": the first interface whose name starts so),
# exact names ("=ib0") and exclusions ("^lo,docker0"); gloo takes one exact name, of an
# interface that exists. An exclusion, or a name that no interface of this node has, leaves the
# choice to gloo.
# route_ifname HOST: the interface this node's route to HOST leaves by, or nothing (HOST does
# not resolve, no ip command, or the route is the loopback). gloo, left to itself, advertises the
# address its own host name resolves to, which Debian and Ubuntu map to 127.0.1.1 in /etc/hosts:
# the other nodes cannot reach that, and every multi-node run stops before its first step.
route_ifname() {
  local addr dev
  addr=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}')
  [ -n "$addr" ] && command -v ip >/dev/null 2>&1 || return 0
  dev=$(ip -o route get "$addr" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -n 1)
  if [ -n "$dev" ] && [ "$dev" != lo ]; then echo "$dev"; fi
}

# gloo_peer NODE MASTER OTHER: the host whose route gives NODE its gloo interface: the master,
# or, on the master itself (whose own name may resolve to the loopback), another node.
gloo_peer() {
  if [ "$1" = "$2" ] || [ "$1" = "${2%%.*}" ]; then echo "$3"; else echo "$2"; fi
}

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
