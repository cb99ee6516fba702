#!/usr/bin/env bash
# A cluster on one machine: network namespaces as nodes, joined through bandwidth-shaped links (tc tbf).
#
#   jobs/netns-cluster.sh up N RATE     # N nodes (1..64), RATE per link and direction: 10gbit, 1gbit, 100mbit, ...
#   jobs/netns-cluster.sh args          # the mpiexec arguments that start ranks inside the nodes (after up)
#   jobs/netns-cluster.sh status        # what is up
#   jobs/netns-cluster.sh down          # remove everything up made (and only that); nothing up: a no-op
#
# Then, from any directory outside /tmp (every node has its own /tmp and /dev/shm):
#   mpiexec $(jobs/netns-cluster.sh args) -n 4 -ppn 2 python -m hpcpipe.train
#
# What `up` makes (all names start with NAME-, HPCPIPE_NETNS_NAME, default hpcpipe; docs/cluster.md
# "A cluster on one machine"; two clusters up at once need their own NAME and HPCPIPE_NETNS_NET):
#   * per node K: a network namespace NAME-nodeK holding lo and eth0 = NET.(K+1)/24, the namespace end
#     of a veth pair whose host end NAME-vK is a port of the bridge NAME-br (NET.254/24, the
#     "switch" and the launching host's address); a tbf qdisc of RATE on both ends (egress of each:
#     into and out of the node), so every byte between two nodes crosses two links of RATE
#   * the state directory HPCPIPE_NETNS_DIR (default /run/NAME-netns): hostfile `hosts`, the
#     launcher `launch` (hydra's -launcher-exec, used as ssh), `mpiexec-args`, per-node tmp/, `made`
#     (every object up created, one per line, read by down)
# A rank starts inside its node's namespace with its own UTS name (hostname NAME-nodeK) and its own
# mount namespace: a fresh tmpfs on /dev/shm and the node's own /tmp, as on real nodes; everything
# else (the repository, the venv, /run, /var/tmp, /work...) is the "shared file system".
# Limits of the emulation: one kernel, so one memory pool, one set of cores, one clock; no latency
# (netem is not available here): only bandwidth is shaped.
set -euo pipefail

NAME=${HPCPIPE_NETNS_NAME:-hpcpipe}      # prefix of every name made: NAME-nodeK, NAME-vK, NAME-br, /run/NAME-netns
STATE=${HPCPIPE_NETNS_DIR:-/run/$NAME-netns}
NET=${HPCPIPE_NETNS_NET:-10.213.7}       # the /24 the nodes live in (.1 .. .N) and the host (.254)
BRIDGE=$NAME-br
PREFIX=$NAME-node

die() { echo "netns-cluster: $*" >&2; exit 2; }
say() { echo "netns-cluster: $*"; }

usage() {
    cat >&2 <<EOF
usage: $0 up N RATE | args | status | down
  up N RATE   N emulated nodes (1..64) joined through links of RATE (e.g. 10gbit, 1gbit, 100mbit)
  args        print the mpiexec arguments that place ranks in the nodes
  status      show the nodes and their links
  down        remove everything up made
EOF
    exit 2
}

need_root() {
    [ "$(id -u)" = 0 ] || die "$1 needs root (network namespaces, veth links and tc qdiscs are root-only); run it with sudo"
    for tool in ip tc unshare mount mountpoint; do
        command -v "$tool" >/dev/null 2>&1 || die "'$tool' is not installed (apt-get install iproute2 util-linux mount)"
    done
}

# Everything `up` creates is recorded before the next step, so `down` (also the one a failed `up` runs)
# removes exactly that: "netns NAME", "link NAME", "dir PATH".
record() { echo "$1" >> "$STATE/made"; }

rate_bits() {    # tc rate text -> bits per second (integer); empty when not a rate
    local rate=${1,,} n unit
    [[ "$rate" =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit)$ ]] || return 0
    n=${BASH_REMATCH[1]}; unit=${BASH_REMATCH[2]}
    case "$unit" in
        bit) echo "$n" ;; kbit) echo $((n * 1000)) ;; mbit) echo $((n * 1000000)) ;;
        gbit) echo $((n * 1000000000)) ;; tbit) echo $((n * 1000000000000)) ;;
    esac
}

shape() {    # shape NETNS_OR_EMPTY DEV RATE_BITS: a tbf qdisc as the root of DEV's egress
    local ns=$1 dev=$2 bits=$3 burst
    # burst: at least one 64 KiB GSO segment, else 1 ms at the rate (a 1000 Hz timer's worth)
    burst=$((bits / 8 / 1000)); (( burst >= 65536 )) || burst=65536
    if [ -n "$ns" ]; then
        ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "${bits}bit" burst "$burst" latency 50ms
    else
        tc qdisc replace dev "$dev" root tbf rate "${bits}bit" burst "$burst" latency 50ms
    fi
}

write_launcher() {    # the program hydra runs as "ssh HOST COMMAND": HOST -> namespace, then COMMAND there
    local n=$1 k cases=""
    for ((k = 0; k < n; k++)); do
        cases+="    $NET.$((k + 1))|$PREFIX$k) node=$PREFIX$k ;;"$'\n'
    done
    cat > "$STATE/launch" <<EOF
#!/usr/bin/env bash
# Written by jobs/netns-cluster.sh up: hydra's launcher (mpiexec -launcher ssh -launcher-exec THIS).
# Called as ssh would be: [options] HOST COMMAND...; runs COMMAND in HOST's namespace as that node.
set -euo pipefail
while [ \$# -gt 0 ] && [[ "\$1" == -* ]]; do shift; done    # ssh options hydra adds (-x)
[ \$# -ge 2 ] || { echo "netns-cluster launcher: usage: \$0 [-x] HOST COMMAND..." >&2; exit 255; }
host=\$1; shift
case "\$host" in
$cases    *) echo "netns-cluster launcher: '\$host' is not a node of this cluster ($NET.1 .. $NET.$n)" >&2; exit 255 ;;
esac
[ -e "/run/netns/\$node" ] || { echo "netns-cluster launcher: node \$node is gone (jobs/netns-cluster.sh down ran?)" >&2; exit 255; }
# UCX (MPICH's netmod here) takes every peer on this kernel for a local one and would pass messages
# through shared memory and CMA between nodes: only TCP and self (MPICH's own shared memory still
# carries the messages between ranks of one node). A UCX_TLS in mpiexec's environment wins (hydra).
export UCX_TLS=\${UCX_TLS:-tcp,self}
# ssh joins its arguments into one shell command line: so do we. New UTS, IPC and mount namespaces per
# launch (one per node and job): the node's hostname, System V IPC, its own /dev/shm and /tmp.
exec ip netns exec "\$node" unshare --uts --ipc --mount --propagation private -- /bin/sh -c '
    hostname "\$1" && mount -t tmpfs -o mode=1777 $NAME-shm /dev/shm && mount --bind "\$2" /tmp || exit 255
    shift 2; exec /bin/sh -c "\$*"' node-init "\$node" "$STATE/nodes/\$node/tmp" "\$*"
EOF
    chmod 755 "$STATE/launch"
}

cmd_up() {
    [ $# -eq 2 ] || usage
    local n=$1 rate=$2 bits k ns veth
    up_done=0
    [[ "$n" =~ ^[1-9][0-9]?$ ]] && (( n <= 64 )) || die "N must be a node count from 1 to 64; got '$n'"
    bits=$(rate_bits "$rate")
    [ -n "$bits" ] && (( bits >= 8000 )) || die "RATE must be a tc rate of at least 8kbit, like 10gbit, 1gbit or 100mbit; got '$rate'"
    [[ "$NAME" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "HPCPIPE_NETNS_NAME must be 1 to 8 lower-case letters and digits, starting with a letter; got '$NAME'"
    [[ "$NET" =~ ^(10|172|192)\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "HPCPIPE_NETNS_NET must be the first three numbers of a private /24, like 10.213.7; got '$NET'"
    need_root up
    [ ! -e "$STATE/made" ] || die "a cluster is already up ($STATE/made); run '$0 down' first"
    # Namespaces must work here: a probe namespace, removed at once (containers without CAP_SYS_ADMIN refuse).
    local probe="$NAME-probe-$$" fresh_rundir=0
    # `ip netns add` makes /run/netns (a bind mount of itself) the first time: ours to remove then
    [ -e /run/netns ] || fresh_rundir=1
    ip netns add "$probe" 2>/dev/null || { (( fresh_rundir == 0 )) || remove_rundir; die "network namespaces are unavailable here ('ip netns add' failed: no CAP_SYS_ADMIN, or a kernel without CONFIG_NET_NS)"; }
    ip netns del "$probe"
    ip link show "$BRIDGE" >/dev/null 2>&1 && die "a link named $BRIDGE exists but no cluster is recorded in $STATE; remove it by hand (ip link del $BRIDGE)"
    if ip -4 -o addr show | grep -q " $NET\."; then
        die "addresses in $NET.0/24 are in use on this host: choose another HPCPIPE_NETNS_NET"
    fi
    if ip -4 route show | grep -v '^default' | grep -q "^$NET\."; then
        die "a route to $NET.0/24 exists on this host: choose another HPCPIPE_NETNS_NET"
    fi
    mkdir -p "$STATE"
    : > "$STATE/made"
    # any failure from here on (an error, a refusal) removes what this `up` made so far
    trap 'if [ "$up_done" = 0 ]; then echo "netns-cluster: up failed; removing what it made" >&2; cmd_down >&2 || true; fi' EXIT
    record "dir $STATE"
    (( fresh_rundir == 0 )) || record "rundir /run/netns"
    ip link add "$BRIDGE" type bridge
    record "link $BRIDGE"
    ip addr add "$NET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((k = 0; k < n; k++)); do
        ns=$PREFIX$k; veth=$NAME-v$k
        ip netns add "$ns"
        record "netns $ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        record "link $veth"
        ip link set "$veth" master "$BRIDGE" up
        shape "" "$veth" "$bits"
        ip netns exec "$ns" ip link set lo up
        ip netns exec "$ns" ip addr add "$NET.$((k + 1))/24" dev eth0
        ip netns exec "$ns" ip link set eth0 up
        shape "$ns" eth0 "$bits"
        mkdir -p "$STATE/nodes/$ns/tmp"
        chmod 1777 "$STATE/nodes/$ns/tmp"
    done
    for ((k = 0; k < n; k++)); do echo "$NET.$((k + 1))"; done > "$STATE/hosts"
    write_launcher "$n"
    echo "-f $STATE/hosts -launcher ssh -launcher-exec $STATE/launch -localhost $NET.254" > "$STATE/mpiexec-args"
    echo "$n $rate" > "$STATE/cluster"
    # wait (up to 5 s) until the bridge forwards on every port (3 = forwarding; at once without STP)
    for ((k = 0; k < n; k++)); do
        local tries=0
        until [ "$(cat "/sys/class/net/$NAME-v$k/brport/state" 2>/dev/null)" = 3 ]; do
            tries=$((tries + 1)); (( tries < 50 )) || die "the bridge does not forward on $NAME-v$k"
            sleep 0.1
        done
    done
    up_done=1
    say "up: $n node(s) ${PREFIX}0..${PREFIX}$((n - 1)) at $NET.1..$NET.$n, links of $rate each way; host $NET.254"
    say "run from a directory outside /tmp:  mpiexec $(cat "$STATE/mpiexec-args") -n RANKS [-ppn PER_NODE] python -m hpcpipe.train"
}

remove_rundir() {    # /run/netns, when up made it and no namespace of anyone else lives there now
    [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ] || return 0
    while mountpoint -q /run/netns; do umount /run/netns || return 0; done
    rmdir /run/netns
}

cmd_down() {
    [ -e "$STATE/made" ] || { say "down: nothing is up (no $STATE/made)"; return 0; }
    need_root down
    local kind name pid
    # Processes still running in a node (a job's ranks) would keep its namespace and link alive.
    while read -r kind name; do
        [ "$kind" = netns ] && [ -e "/run/netns/$name" ] || continue
        for pid in $(ip netns pids "$name" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
    done < "$STATE/made"
    sleep 0.2
    while read -r kind name; do
        [ "$kind" = netns ] && [ -e "/run/netns/$name" ] || continue
        for pid in $(ip netns pids "$name" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    done < "$STATE/made"
    # In reverse order of creation: a node's link before its namespace, the bridge last.
    tac "$STATE/made" | while read -r kind name; do
        case "$kind" in
            link) if ip link show "$name" >/dev/null 2>&1; then ip link del "$name"; fi ;;
            netns) if [ -e "/run/netns/$name" ]; then ip netns del "$name"; fi ;;
            rundir) remove_rundir ;;
            dir) ;;
        esac
    done
    rm -rf "$STATE/nodes" "$STATE/hosts" "$STATE/launch" "$STATE/mpiexec-args" "$STATE/cluster" "$STATE/made"
    rmdir "$STATE" 2>/dev/null || say "down: left $STATE in place (it holds files up did not make)"
    say "down: removed every node, link and file up made"
}

cmd_args() {
    [ -e "$STATE/mpiexec-args" ] || die "no cluster is up (no $STATE/mpiexec-args); run '$0 up N RATE' first"
    cat "$STATE/mpiexec-args"
}

cmd_status() {
    [ -e "$STATE/cluster" ] || { say "status: nothing is up"; return 0; }
    local n rate
    read -r n rate < "$STATE/cluster"
    say "status: $n node(s), links of $rate; mpiexec $(cat "$STATE/mpiexec-args")"
    ip -br link show master "$BRIDGE" 2>/dev/null || true
}

case "${1:-}" in
    up) shift; cmd_up "$@" ;;
    down) [ $# -eq 1 ] || usage; cmd_down ;;
    args) cmd_args ;;
    status) cmd_status ;;
    *) usage ;;
esac
