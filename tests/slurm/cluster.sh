#!/usr/bin/env bash
# Bring up / tear down a throwaway 2-node SLURM cluster on this one machine,
# for the test suite.
#
#   tests/slurm/cluster.sh up|down|status
#
# Layout (defaults; override with DSKIT_SLURM_SUBNET=A.B.C.0/24 and
# DSKIT_SLURM_BRIDGE=<name, at most 12 chars>):
#   bridge dsk-br0 10.77.0.1/24 in the root namespace (slurmctld, munged)
#   netns dsk-node1: eth0 10.77.0.11, hostname node1 (UTS ns), slurmd -N node1
#   netns dsk-node2: eth0 10.77.0.12, hostname node2 (UTS ns), slurmd -N node2
# Only the network and UTS namespaces differ: the filesystem (and therefore
# /etc/hosts, /tmp, the repo, the venv) is shared by the nodes and the host.
#
# Needs root on Debian. Installs munge/slurmctld/slurmd/slurm-client with apt
# when missing. Never starts anything through an init system.
set -euo pipefail

readonly TAG="dskit-slurm-cluster"
readonly STATE_DIR="/run/dskit-slurm"
readonly STATE_FILE="${STATE_DIR}/state"
readonly MUNGE_MARKER="${STATE_DIR}/munged.started-by-dskit"
readonly CTLD_PIDFILE="${STATE_DIR}/slurmctld.pid"
readonly CONF="/etc/slurm/slurm.conf"
readonly CONF_BACKUP="/etc/slurm/slurm.conf.dskit-backup"
readonly CTLD_STATE_DIR="/var/spool/dskit-slurmctld"
readonly SLURMD_SPOOL="/var/spool/dskit-slurmd"
readonly LOG_DIR="/var/log/slurm"
readonly CTLD_LOG="${LOG_DIR}/dskit-slurmctld.log"
readonly MUNGE_PIDFILE="/run/munge/munged.pid"
readonly APT_LOG="/tmp/dskit-slurm-apt.log"
readonly NODES=(node1 node2)
readonly HOST_OCTETS=(11 12)
readonly PACKAGES=(munge slurmctld slurmd slurm-client iproute2 util-linux)
readonly WAIT_IDLE_S="${DSKIT_SLURM_WAIT_S:-60}"

BRIDGE=""
PREFIX="" # first three octets, e.g. 10.77.0
CTL_IP=""

log() { printf 'cluster.sh: %s\n' "$*" >&2; }
die() {
    log "$*"
    exit 1
}
refuse() {
    log "$*"
    exit 2
}

now() { date +%s.%N; }
elapsed_since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

netns_of() { printf 'dsk-%s' "$1"; }                # node -> netns name
veth_of() { printf '%s-n%s' "$BRIDGE" "$(($1 + 1))"; } # index -> host-side veth
node_ip() { printf '%s.%s' "$PREFIX" "${HOST_OCTETS[$1]}"; }
slurmd_pidfile() { printf '%s/slurmd-%s.pid' "$STATE_DIR" "$1"; }

# --------------------------------------------------------------------------
# configuration: the state file written by `up` wins over the environment, so
# `down` cleans up what `up` created even when the env vars changed meanwhile.
load_config() {
    local subnet="${DSKIT_SLURM_SUBNET:-10.77.0.0/24}"
    BRIDGE="${DSKIT_SLURM_BRIDGE:-dsk-br0}"
    if [[ -r "$STATE_FILE" ]]; then
        local key value
        while IFS='=' read -r key value; do
            case "$key" in
                subnet) subnet="$value" ;;
                bridge) BRIDGE="$value" ;;
            esac
        done <"$STATE_FILE"
    fi
    if [[ ! "$subnet" =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.0/24$ ]]; then
        refuse "DSKIT_SLURM_SUBNET must look like A.B.C.0/24, got '${subnet}'"
    fi
    PREFIX="${BASH_REMATCH[1]}.${BASH_REMATCH[2]}.${BASH_REMATCH[3]}"
    CTL_IP="${PREFIX}.1"
    if [[ ! "$BRIDGE" =~ ^[A-Za-z0-9_.-]{1,12}$ ]]; then
        refuse "DSKIT_SLURM_BRIDGE must be 1-12 chars of [A-Za-z0-9_.-], got '${BRIDGE}'"
    fi
}

save_config() {
    install -d -m 0755 "$STATE_DIR"
    printf 'subnet=%s.0/24\nbridge=%s\n' "$PREFIX" "$BRIDGE" >"$STATE_FILE"
}

# --------------------------------------------------------------------------
# process helpers ("kill -0" succeeds on zombies: look at State: instead)
pid_alive() {
    local state
    state="$(awk '/^State:/ { print $2; exit }' "/proc/$1/status" 2>/dev/null)" || return 1
    [[ -n "$state" && "$state" != "Z" && "$state" != "X" ]]
}

# pid from a pid file, only if that process is alive and is `comm`
pidfile_pid() {
    local file="$1" comm="$2" pid="" actual=""
    [[ -r "$file" ]] || return 1
    read -r pid <"$file" || true
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    pid_alive "$pid" || return 1
    read -r actual <"/proc/${pid}/comm" 2>/dev/null || return 1
    [[ "$actual" == "$comm" ]] || return 1
    printf '%s\n' "$pid"
}

# wait until none of the pids is alive; returns 1 on timeout
wait_dead() {
    local timeout="$1" pid any
    shift
    local deadline
    deadline="$(awk -v t="$(now)" -v d="$timeout" 'BEGIN { printf "%.3f", t + d }')"
    while :; do
        any=0
        for pid in "$@"; do
            if pid_alive "$pid"; then
                any=1
                break
            fi
        done
        ((any)) || return 0
        if awk -v t="$(now)" -v d="$deadline" 'BEGIN { exit !(t > d) }'; then
            return 1
        fi
        sleep 0.05
    done
}

# TERM, wait up to $1 s, then KILL
terminate() {
    local timeout="$1"
    shift
    (($# > 0)) || return 0
    kill -TERM "$@" 2>/dev/null || true
    if ! wait_dead "$timeout" "$@"; then
        kill -KILL "$@" 2>/dev/null || true
        wait_dead 5 "$@" || log "warning: pid(s) $* survived SIGKILL"
    fi
}

stop_pidfile() {
    local file="$1" comm="$2" pid
    if pid="$(pidfile_pid "$file" "$comm")"; then
        terminate 10 "$pid"
    fi
    rm -f -- "$file"
}

netns_pids() {
    local ns="$1"
    [[ -e "/run/netns/${ns}" ]] || return 0
    ip netns pids "$ns" 2>/dev/null || true
}

# is pid inside network namespace ns?
pid_in_netns() {
    local pid="$1" ns="$2" link inode
    link="$(readlink "/proc/${pid}/ns/net" 2>/dev/null)" || return 1
    inode="$(stat -L -c '%i' "/run/netns/${ns}" 2>/dev/null)" || return 1
    [[ "$link" == "net:[${inode}]" ]]
}

# --------------------------------------------------------------------------
# /etc/hosts is rewritten in place (it may be a bind mount: no rename)
hosts_without_ours() { grep -v -- "# ${TAG}\$" /etc/hosts || true; }

hosts_remove() {
    grep -q -- "# ${TAG}\$" /etc/hosts 2>/dev/null || return 0
    local content
    content="$(hosts_without_ours)"
    printf '%s\n' "$content" >/etc/hosts
}

hosts_add() {
    local content i
    content="$(hosts_without_ours)"
    for i in "${!NODES[@]}"; do
        content+=$'\n'"$(node_ip "$i") ${NODES[$i]} # ${TAG}"
    done
    if [[ "$content" != "$(cat /etc/hosts)" ]]; then
        printf '%s\n' "$content" >/etc/hosts
    fi
}

# --------------------------------------------------------------------------
preflight() {
    ((EUID == 0)) || refuse "up needs root (running as uid ${EUID})"
    [[ -f /etc/debian_version ]] || refuse "up needs Debian (/etc/debian_version missing)"
}

pkg_installed() {
    [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" == "install ok installed" ]]
}

ensure_packages() {
    local missing=() pkg
    for pkg in "${PACKAGES[@]}"; do
        pkg_installed "$pkg" || missing+=("$pkg")
    done
    if ((${#missing[@]} > 0)); then
        log "installing ${missing[*]} with apt-get, with their dependencies, for this test cluster (log: ${APT_LOG})"
        local apt=(apt-get install -y --no-install-recommends "${missing[@]}")
        if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >"$APT_LOG" 2>&1; then
            DEBIAN_FRONTEND=noninteractive apt-get update >>"$APT_LOG" 2>&1 || true
            DEBIAN_FRONTEND=noninteractive "${apt[@]}" >>"$APT_LOG" 2>&1 ||
                die "apt-get install ${missing[*]} failed, see ${APT_LOG}"
        fi
    fi
    local tool
    for tool in ip nsenter unshare slurmctld slurmd sinfo scontrol munged munge unmunge runuser; do
        command -v "$tool" >/dev/null 2>&1 || refuse "required command '${tool}' not found"
    done
    [[ -r /etc/munge/munge.key ]] || die "/etc/munge/munge.key missing"
}

setup_network() {
    [[ -e /run/netns ]] || : >"${STATE_DIR}/created-run-netns"
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add name "$BRIDGE" type bridge
    ip addr replace "${CTL_IP}/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local i ns veth
    for i in "${!NODES[@]}"; do
        ns="$(netns_of "${NODES[$i]}")"
        veth="$(veth_of "$i")"
        [[ -e "/run/netns/${ns}" ]] || ip netns add "$ns"
        if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
            ip link del "$veth" >/dev/null 2>&1 || true
            ip link add "$veth" type veth peer name eth0 netns "$ns"
        fi
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr replace "$(node_ip "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" route replace default via "$CTL_IP"
        block_nameservers "$ns"
    done
}

# The root namespace does not forward (no NAT), so DNS queries sent from a
# node namespace vanish and every lookup that misses /etc/hosts waits for the
# resolver timeout (10+ s; torch's c10d store does such reverse lookups of
# ::ffff:a.b.c.d peers). Unreachable routes to the nameservers make those
# lookups fail at once instead.
block_nameservers() {
    local ns="$1" key addr _
    [[ -r /etc/resolv.conf ]] || return 0
    while read -r key addr _; do
        [[ "$key" == "nameserver" && -n "$addr" ]] || continue
        case "$addr" in
            127.* | ::1 | "${PREFIX}".*) ;;
            *:*) ip -n "$ns" -6 route replace unreachable "${addr}/128" >/dev/null 2>&1 || true ;;
            *.*.*.*) ip -n "$ns" route replace unreachable "${addr}/32" >/dev/null 2>&1 || true ;;
        esac
    done </etc/resolv.conf
}

render_conf() {
    local cpus mem_mb i
    cpus="$(nproc)"
    mem_mb="$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 }' /proc/meminfo)"
    if ((mem_mb > 2000)); then mem_mb=2000; fi
    cat <<EOF
# ${TAG}: written by tests/slurm/cluster.sh; removed/restored by 'down'
ClusterName=dskit
SlurmctldHost=$(hostname -s)(${CTL_IP})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=5,bf_interval=5
ReturnToService=2
SlurmdTimeout=30
KillWait=5
MinJobAge=300
StateSaveLocation=${CTLD_STATE_DIR}
SlurmctldPidFile=${CTLD_PIDFILE}
SlurmctldLogFile=${CTLD_LOG}
SlurmdSpoolDir=${SLURMD_SPOOL}/%n
SlurmdPidFile=${STATE_DIR}/slurmd-%n.pid
SlurmdLogFile=${LOG_DIR}/dskit-slurmd-%n.log
EOF
    for i in "${!NODES[@]}"; do
        printf 'NodeName=%s NodeAddr=%s CPUs=%s RealMemory=%s State=UNKNOWN\n' \
            "${NODES[$i]}" "$(node_ip "$i")" "$cpus" "$mem_mb"
    done
    printf 'PartitionName=debug Nodes=%s Default=YES MaxTime=INFINITE State=UP\n' \
        "$(
            IFS=,
            echo "${NODES[*]}"
        )"
}

conf_is_ours() { [[ -f "$CONF" ]] && head -n1 "$CONF" | grep -q -- "^# ${TAG}:"; }

# writes slurm.conf; returns 0 if it changed, 1 if it was already current
write_conf() {
    local content
    content="$(render_conf)"
    install -d -m 0755 /etc/slurm
    if [[ -e "$CONF" ]] && ! conf_is_ours && [[ ! -e "$CONF_BACKUP" ]]; then
        cp -p -- "$CONF" "$CONF_BACKUP"
    fi
    if [[ -f "$CONF" ]] && [[ "$content" == "$(cat "$CONF")" ]]; then
        return 1
    fi
    printf '%s\n' "$content" >"$CONF"
    chmod 0644 "$CONF"
    return 0
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munged() {
    munge_works && return 0
    [[ -e /run/munge ]] || : >"${STATE_DIR}/created-run-munge"
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged --force
    : >"$MUNGE_MARKER"
    local _
    for _ in $(seq 200); do
        munge_works && return 0
        sleep 0.05
    done
    die "munged did not come up (munge -n | unmunge keeps failing)"
}

start_slurmctld() {
    local restart="$1"
    if pidfile_pid "$CTLD_PIDFILE" slurmctld >/dev/null && ((!restart)); then
        return 0
    fi
    stop_pidfile "$CTLD_PIDFILE" slurmctld
    # -c: throwaway cluster, never recover jobs from an earlier incarnation
    slurmctld -c || die "slurmctld failed to start, see ${CTLD_LOG}"
}

start_slurmd() {
    local node="$1" restart="$2" ns pidfile pid
    ns="$(netns_of "$node")"
    pidfile="$(slurmd_pidfile "$node")"
    if pid="$(pidfile_pid "$pidfile" slurmd)" && pid_in_netns "$pid" "$ns" && ((!restart)); then
        return 0
    fi
    stop_pidfile "$pidfile" slurmd
    install -d -m 0755 "${SLURMD_SPOOL}/${node}"
    # not `ip netns exec`: it remounts /sys and slurmd then finds no cgroup fs
    # shellcheck disable=SC2016 # $1 expands in the inner sh, on purpose
    nsenter --net="/run/netns/${ns}" -- unshare --uts -- \
        sh -c 'hostname "$1" && exec slurmd -N "$1"' sh "$node" ||
        die "slurmd ${node} failed to start, see ${LOG_DIR}/dskit-slurmd-${node}.log"
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null || true; }

wait_idle() {
    local deadline state_lines node state all_idle
    deadline="$(awk -v t="$(now)" -v d="$WAIT_IDLE_S" 'BEGIN { printf "%.3f", t + d }')"
    while :; do
        state_lines="$(node_states)"
        all_idle=1
        for node in "${NODES[@]}"; do
            state="$(awk -v n="$node" '$1 == n { print $2; exit }' <<<"$state_lines")"
            case "$state" in
                idle) ;;
                down | drained | fail)
                    # e.g. set down by a previous test: responding again, resume it
                    all_idle=0
                    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
                    ;;
                *) all_idle=0 ;;
            esac
        done
        if ((all_idle)); then return 0; fi
        if awk -v t="$(now)" -v d="$deadline" 'BEGIN { exit !(t > d) }'; then
            log "nodes not idle after ${WAIT_IDLE_S} s:"
            printf '%s\n' "$state_lines" >&2
            local f
            for f in "$CTLD_LOG" "${LOG_DIR}"/dskit-slurmd-*.log; do
                [[ -r "$f" ]] || continue
                log "--- tail ${f}"
                tail -n 15 "$f" >&2 || true
            done
            exit 1
        fi
        sleep 0.1
    done
}

cmd_up() {
    local t0 changed=0 node
    t0="$(now)"
    preflight
    load_config
    ensure_packages
    save_config
    setup_network
    hosts_add
    if write_conf; then changed=1; fi
    install -d -m 0755 "$LOG_DIR" "$CTLD_STATE_DIR" "$SLURMD_SPOOL"
    start_munged
    start_slurmctld "$changed"
    for node in "${NODES[@]}"; do
        start_slurmd "$node" "$changed"
    done
    wait_idle
    printf 'cluster up in %s s\n' "$(elapsed_since "$t0")"
}

cmd_down() {
    local t0 node i pids=()
    t0="$(now)"
    ((EUID == 0)) || refuse "down needs root (running as uid ${EUID})"
    load_config
    for node in "${NODES[@]}"; do
        stop_pidfile "$(slurmd_pidfile "$node")" slurmd
    done
    # leftover job processes (slurmstepd, tasks) live in the node namespaces;
    # they are throwaway: SIGKILL, no grace period
    for node in "${NODES[@]}"; do
        mapfile -t -O "${#pids[@]}" pids < <(netns_pids "$(netns_of "$node")")
    done
    if ((${#pids[@]} > 0)); then
        kill -KILL "${pids[@]}" 2>/dev/null || true
        wait_dead 5 "${pids[@]}" || log "warning: job pid(s) survived SIGKILL: ${pids[*]}"
    fi
    stop_pidfile "$CTLD_PIDFILE" slurmctld
    if [[ -e "$MUNGE_MARKER" ]]; then
        stop_pidfile "$MUNGE_PIDFILE" munged
        rm -f -- "$MUNGE_MARKER"
    fi
    for i in "${!NODES[@]}"; do
        node="${NODES[$i]}"
        # veth first (takes its peer along); netns removal is asynchronous
        ip link del "$(veth_of "$i")" >/dev/null 2>&1 || true
        if [[ -e "/run/netns/$(netns_of "$node")" ]]; then
            ip netns del "$(netns_of "$node")" || log "warning: could not delete netns $(netns_of "$node")"
        fi
    done
    # /run/netns (a bind mount made by `ip netns add`) and /run/munge: only
    # when this script created them and they are empty now
    if [[ -e "${STATE_DIR}/created-run-netns" ]] && [[ -d /run/netns ]] &&
        [[ -z "$(ls -A /run/netns)" ]]; then
        umount -n /run/netns 2>/dev/null || true
        rmdir /run/netns 2>/dev/null || true
    fi
    if [[ -e "${STATE_DIR}/created-run-munge" ]] && [[ -d /run/munge ]]; then
        rmdir /run/munge 2>/dev/null || true
    fi
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE" || log "warning: could not delete bridge ${BRIDGE}"
    fi
    hosts_remove
    if [[ -e "$CONF_BACKUP" ]]; then
        mv -f -- "$CONF_BACKUP" "$CONF"
    elif conf_is_ours; then
        rm -f -- "$CONF"
    fi
    rm -rf -- "$STATE_DIR" "$CTLD_STATE_DIR" "$SLURMD_SPOOL"
    printf 'cluster down in %s s\n' "$(elapsed_since "$t0")"
}

cmd_status() {
    local out
    if [[ -e "$STATE_FILE" ]] && pidfile_pid "$CTLD_PIDFILE" slurmctld >/dev/null &&
        out="$(timeout 15 sinfo 2>/dev/null)"; then
        printf '%s\n' "$out"
        return 0
    fi
    echo "cluster is down"
    return 1
}

main() {
    case "${1:-}" in
        up) cmd_up ;;
        down) cmd_down ;;
        status) cmd_status ;;
        *)
            echo "usage: $0 up|down|status" >&2
            exit 2
            ;;
    esac
}

main "$@"
