#!/bin/sh
# ops/nofile-exec.sh WANT COMMAND [ARGS...] — exec COMMAND with an open-file limit of WANT
# (ulimit -n), or the hard limit if that is lower and cannot be raised. RabbitMQ keeps one
# file handle per queue and connection, and fleet's queue counts need more than the usual
# 1024 (docs/scaling.md). The one copy of this logic: ops/services.sh starts the shared node
# with it, and the test harness (tests/src/servers.rs) starts its private nodes with it, so
# the broker_limits test checks this very script.
# ulimit's -H and -S are not POSIX, but dash (Debian's sh) and bash both have them.
# shellcheck disable=SC3045
want=$1
shift
hard=$(ulimit -H -n)
if [ "$hard" != unlimited ] && [ "$hard" -lt "$want" ]; then
    ulimit -H -n "$want" 2>/dev/null || true
    hard=$(ulimit -H -n)
    if [ "$hard" != unlimited ] && [ "$hard" -lt "$want" ]; then want=$hard; fi
fi
ulimit -S -n "$want" && exec "$@"
