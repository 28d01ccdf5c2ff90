#!/usr/bin/env bash
# ops/cluster.sh — a private three-node RabbitMQ cluster and a Redis master + replica + three
# Sentinels on loopback, for the cluster test (tests/tests/e2e/cluster.rs) and for trying fleet
# past one machine by hand. Never touches the shared servers (rabbit@localhost on 5672, Redis
# on 6379): every process here has its own node name, ports and directories under DIR.
#
#   ops/cluster.sh up [DIR]      start everything (free ports picked at random), wait until
#                                the cluster has three running nodes and Sentinel knows the
#                                master; write DIR/cluster.env (see below). Exit 0 when ready.
#   ops/cluster.sh down [DIR]    stop every process started by `up` (by the pids it recorded)
#                                and delete DIR
#   ops/cluster.sh kill-node N [DIR]   kill -9 RabbitMQ node N (1-3)
#   ops/cluster.sh start-node N [DIR]  start killed node N again (it rejoins the cluster)
#   ops/cluster.sh kill-redis-master [DIR]   kill -9 the Redis server that is master now
#   ops/cluster.sh ctl DIR ARGS...     rabbitmqctl ARGS against the first running node
#
# DIR defaults to /tmp/fleet-cluster. DIR/cluster.env holds shell assignments:
#   FLEET_CLUSTER_AMQP_URL   the three nodes as a FLEET_AMQP_URL list
#   FLEET_CLUSTER_REDIS_URL  redis+sentinel://… for FLEET_REDIS_URL
#   NODE<i>_NAME, NODE<i>_PORT, NODE<i>_DIST, NODE<i>_PID   RabbitMQ node i (1-3; DIST:
#                                              its Erlang distribution port)
#   REDIS<i>_PORT, REDIS<i>_PID                Redis 1 (first master) and 2 (first replica)
#   SENTINEL<i>_PORT, SENTINEL<i>_PID          the Sentinels (1-3)
#   MASTER_NAME                                the master's name in Sentinel
#
# The RabbitMQ nodes run as user `rabbitmq` (the Debian package's) so they share its Erlang
# cookie with each other and with rabbitmqctl; Erlang distribution is bound to 127.0.0.1
# (inet_dist_use_interface), each node with its own dist port. Needs root (or the rabbitmq
# user), rabbitmq-server and redis-server (ops/services.sh installs both).
set -euo pipefail

cmd=${1:-}
case "$cmd" in
    up | down | status) DIR=${2:-/tmp/fleet-cluster} ;;
    kill-node | start-node) N=${2:?node number}; DIR=${3:-/tmp/fleet-cluster} ;;
    kill-redis-master) DIR=${2:-/tmp/fleet-cluster} ;;
    ctl) DIR=${2:?dir}; shift 2 ;;
    *) sed -n '2,30p' "$0"; exit 2 ;;
esac

MASTER_NAME=fleetmaster
HERE=$(cd "$(dirname "$0")" && pwd)
RMQ=/usr/lib/rabbitmq/bin

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# A free port whose neighbour +10000 (Erlang's CLI distribution range) is free too.
free_dist_port() {
    local p
    for _ in $(seq 1 50); do
        p=$(free_port)
        if [ "$p" -lt 55000 ] && ! ss -ltn "sport = :$((p + 10000))" | grep -q LISTEN; then
            echo "$p"
            return
        fi
    done
    echo "no free distribution port" >&2
    return 1
}

as_rabbitmq() {
    if [ "$(id -u)" = "$(id -u rabbitmq)" ]; then
        env HOME=/var/lib/rabbitmq "$@"
    else
        runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq "$@"
    fi
}

# rabbitmqctl against one of our nodes, never the shared one (-n is always given).
ctl() {
    local node=$1
    shift
    as_rabbitmq RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" "$RMQ/rabbitmqctl" -q -n "$node" "$@"
}

load_env() {
    if [ -f "$DIR/cluster.env" ]; then
        # shellcheck disable=SC1091
        . "$DIR/cluster.env"
    fi
}

redis_role() {
    redis-cli -p "$1" role 2>/dev/null | head -1
}

# The nodes inherit this shell's open-file limit: fleet's queue counts need far more than the
# usual 1024 (docs/scaling.md; ops/services.sh does the same for the shared broker).
raise_nofile() {
    local nofile="${RABBITMQ_NOFILE:-65536}" hard
    hard=$(ulimit -H -n)
    if [ "$hard" != unlimited ] && [ "$hard" -lt "$nofile" ]; then
        ulimit -H -n "$nofile" 2>/dev/null || true
        hard=$(ulimit -H -n)
        if [ "$hard" != unlimited ] && [ "$hard" -lt "$nofile" ]; then nofile=$hard; fi
    fi
    ulimit -S -n "$nofile"
}

# Starts RabbitMQ node I (name, AMQP port, distribution port) in the background, its files
# under $DIR/nI (written by `up`).
launch_node() {
    local i=$1 name=$2 port=$3 dist=$4 d="$DIR/n$1"
    as_rabbitmq \
        RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" \
        RABBITMQ_NODENAME="$name" \
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
        RABBITMQ_NODE_PORT="$port" \
        RABBITMQ_DIST_PORT="$dist" \
        RABBITMQ_MNESIA_BASE="$d/mnesia" \
        RABBITMQ_LOG_BASE="$d/log" \
        RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
        RABBITMQ_ADVANCED_CONFIG_FILE="$d/advanced.config" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" \
        RABBITMQ_PID_FILE="$d/pid" \
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
        setsid "$RMQ/rabbitmq-server" >>"$d/stdout.log" 2>&1 </dev/null &
}

# Starts killed node N again with its name, ports and data: it rejoins the cluster (its quorum
# members catch up from the leaders). Waits until it runs; NODE<N>_PID is updated.
start_node() {
    load_env
    local name_var="NODE${N}_NAME" port_var="NODE${N}_PORT" dist_var="NODE${N}_DIST" pid_var="NODE${N}_PID"
    if kill -0 "${!pid_var}" 2>/dev/null; then
        echo "ops/cluster.sh: node $N is running (pid ${!pid_var})" >&2
        exit 1
    fi
    # The killed VM's children and its epmd registration go with it; wait (bounded) until
    # its distribution port is free again.
    timeout 30 bash -c "while ss -ltn 'sport = :${!dist_var}' | grep -q LISTEN; do sleep 0.2; done" || true
    raise_nofile
    rm -f "$DIR/n$N/pid"
    launch_node "$N" "${!name_var}" "${!port_var}" "${!dist_var}"
    timeout 120 bash -c "until [ -s '$DIR/n$N/pid' ]; do sleep 0.5; done" || { echo "node $N wrote no pid file; see $DIR/n$N" >&2; exit 1; }
    ctl "${!name_var}" wait --timeout 120 "$DIR/n$N/pid"
    sed -i "s/^NODE${N}_PID=.*/NODE${N}_PID=$(cat "$DIR/n$N/pid")/" "$DIR/cluster.env"
    echo "started RabbitMQ node $N again"
}

up() {
    if [ -f "$DIR/cluster.env" ]; then
        echo "ops/cluster.sh: $DIR already holds a cluster (run down first)" >&2
        exit 1
    fi
    if ! command -v redis-server >/dev/null || [ ! -x "$RMQ/rabbitmq-server" ]; then
        echo "ops/cluster.sh: needs redis-server and rabbitmq-server (ops/services.sh)" >&2
        exit 1
    fi
    mkdir -p "$DIR"
    chmod 755 "$DIR"
    local tag
    tag=$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')
    # An env file of our own: the package's /etc/rabbitmq/rabbitmq-env.conf names the shared node.
    printf 'ERL_EPMD_ADDRESS=127.0.0.1\n' >"$DIR/rabbitmq-env.conf"
    raise_nofile
    printf '[].\n' >"$DIR/enabled_plugins"
    : >"$DIR/cluster.env"
    local urls=()
    for i in 1 2 3; do
        local d="$DIR/n$i" port dist name
        port=$(free_port)
        dist=$(free_dist_port)
        name="fleetc$i-$tag@localhost"
        mkdir -p "$d/mnesia" "$d/log"
        cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$port
loopback_users.guest = true
log.console = false
log.file.level = info
cluster_partition_handling = pause_minority
EOF
        # Fleet's broker settings beyond rabbitmq.conf (dead-letter re-send after 5 s, not 180 s).
        cp "$HERE/rabbitmq/advanced.config" "$d/advanced.config"
        chown -R rabbitmq:rabbitmq "$d" "$DIR/rabbitmq-env.conf" "$DIR/enabled_plugins"
        launch_node "$i" "$name" "$port" "$dist"
        {
            echo "NODE${i}_NAME=$name"
            echo "NODE${i}_PORT=$port"
            echo "NODE${i}_DIST=$dist"
        } >>"$DIR/cluster.env"
        urls+=("amqp://guest:guest@127.0.0.1:$port/%2f")
    done
    load_env
    for i in 1 2 3; do
        local name_var="NODE${i}_NAME"
        timeout 120 bash -c "until [ -s '$DIR/n$i/pid' ]; do sleep 0.5; done" || { echo "node $i wrote no pid file; see $DIR/n$i" >&2; exit 1; }
        ctl "${!name_var}" wait --timeout 120 "$DIR/n$i/pid"
        echo "NODE${i}_PID=$(cat "$DIR/n$i/pid")" >>"$DIR/cluster.env"
    done
    for i in 2 3; do
        local name_var="NODE${i}_NAME"
        ctl "${!name_var}" stop_app
        ctl "${!name_var}" join_cluster "$NODE1_NAME"
        ctl "${!name_var}" start_app
    done
    local running
    running=$(ctl "$NODE1_NAME" eval 'length(rabbit_nodes:all_running()).')
    if [ "$running" != 3 ]; then
        echo "ops/cluster.sh: the cluster has $running running nodes, not 3" >&2
        exit 1
    fi

    # Redis: master, replica, three Sentinels (no persistence: a restarted server comes back empty).
    local r1 r2
    r1=$(free_port)
    r2=$(free_port)
    for i in 1 2; do
        local p=$r1 extra=()
        [ "$i" = 2 ] && p=$r2 && extra=(--replicaof 127.0.0.1 "$r1")
        redis-server --port "$p" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
            --dir "$DIR" --logfile "$DIR/redis$i.log" "${extra[@]}" </dev/null >/dev/null 2>&1 &
        echo "REDIS${i}_PORT=$p" >>"$DIR/cluster.env"
        echo "REDIS${i}_PID=$!" >>"$DIR/cluster.env"
    done
    local sentinels=()
    for i in 1 2 3; do
        local p
        p=$(free_port)
        cat >"$DIR/sentinel$i.conf" <<EOF
port $p
bind 127.0.0.1
dir $DIR
sentinel monitor $MASTER_NAME 127.0.0.1 $r1 2
sentinel down-after-milliseconds $MASTER_NAME 1000
sentinel failover-timeout $MASTER_NAME 10000
sentinel parallel-syncs $MASTER_NAME 1
EOF
        redis-server "$DIR/sentinel$i.conf" --sentinel --daemonize no --logfile "$DIR/sentinel$i.log" </dev/null >/dev/null 2>&1 &
        echo "SENTINEL${i}_PORT=$p" >>"$DIR/cluster.env"
        echo "SENTINEL${i}_PID=$!" >>"$DIR/cluster.env"
        sentinels+=("127.0.0.1:$p")
    done
    timeout 30 bash -c "until [ \"\$(redis-cli -p $r2 info replication | tr -d '\r' | grep -c master_link_status:up)\" = 1 ]; do sleep 0.2; done" \
        || { echo "the Redis replica did not sync" >&2; exit 1; }
    load_env
    for i in 1 2 3; do
        local p_var="SENTINEL${i}_PORT"
        timeout 30 bash -c "until redis-cli -p ${!p_var} sentinel get-master-addr-by-name $MASTER_NAME 2>/dev/null | grep -q $r1; do sleep 0.2; done" \
            || { echo "Sentinel $i does not know the master" >&2; exit 1; }
    done
    local IFS=,
    {
        echo "MASTER_NAME=$MASTER_NAME"
        echo "FLEET_CLUSTER_AMQP_URL='${urls[*]}'"
        echo "FLEET_CLUSTER_REDIS_URL='redis+sentinel://${sentinels[*]}/$MASTER_NAME'"
    } >>"$DIR/cluster.env"
    echo "ops/cluster.sh: up ($DIR/cluster.env)"
}

down() {
    load_env
    for i in 1 2 3; do
        local pid_var="NODE${i}_PID" name_var="NODE${i}_NAME"
        if [ -n "${!pid_var:-}" ] && kill -0 "${!pid_var}" 2>/dev/null; then
            ctl "${!name_var}" stop >/dev/null 2>&1 || kill -9 "${!pid_var}" 2>/dev/null || true
        fi
    done
    for v in REDIS1_PID REDIS2_PID SENTINEL1_PID SENTINEL2_PID SENTINEL3_PID; do
        if [ -n "${!v:-}" ]; then
            kill "${!v}" 2>/dev/null || true
        fi
    done
    # A killed node may have left its epmd registration and beam children: by pid file only.
    for i in 1 2 3; do
        if [ -s "$DIR/n$i/pid" ]; then
            kill -9 "$(cat "$DIR/n$i/pid")" 2>/dev/null || true
        fi
    done
    # Wait (bounded) for every recorded process to exit before removing their files.
    for _ in $(seq 1 50); do
        local alive=0
        for v in NODE1_PID NODE2_PID NODE3_PID REDIS1_PID REDIS2_PID SENTINEL1_PID SENTINEL2_PID SENTINEL3_PID; do
            if [ -n "${!v:-}" ] && kill -0 "${!v}" 2>/dev/null; then
                alive=1
            fi
        done
        [ "$alive" = 0 ] && break
        sleep 0.2
    done
    case "$DIR" in
        /tmp/*) rm -rf "$DIR" ;;
        *) echo "ops/cluster.sh: left $DIR in place (not under /tmp)" ;;
    esac
}

case "$cmd" in
    up) up ;;
    down) down ;;
    status)
        load_env
        ctl "$NODE1_NAME" cluster_status
        for i in 1 2; do
            local_port_var="REDIS${i}_PORT"
            echo "redis $i (${!local_port_var}): $(redis_role "${!local_port_var}")"
        done
        ;;
    start-node) start_node ;;
    kill-node)
        load_env
        pid_var="NODE${N}_PID"
        kill -9 "${!pid_var}"
        ;;
    ctl)
        load_env
        for i in 1 2 3; do
            pid_var="NODE${i}_PID"
            name_var="NODE${i}_NAME"
            if kill -0 "${!pid_var}" 2>/dev/null; then
                ctl "${!name_var}" "$@"
                exit $?
            fi
        done
        echo "no running node" >&2
        exit 1
        ;;
    kill-redis-master)
        load_env
        for i in 1 2; do
            p_var="REDIS${i}_PORT"
            pid_var="REDIS${i}_PID"
            if [ "$(redis_role "${!p_var}")" = master ]; then
                kill -9 "${!pid_var}"
                echo "killed redis $i (port ${!p_var})"
                exit 0
            fi
        done
        echo "no Redis master found" >&2
        exit 1
        ;;
esac
