#!/usr/bin/env bash
# ops/bench/celery_bench.sh — Celery peer benchmark (see celery_bench.py for what it measures).
#
#   ops/bench/celery_bench.sh [--n 20000] [--idle 200] [--amqp URL] [--redis URL] [--concurrency 8]
#
# Creates once (and reuses) a virtualenv at ${CELERY_VENV:-target/celery-venv}, relative to the
# repository root, with celery>=5.4,<6 and redis from PyPI, then runs celery_bench.py with it.
# Exit 3: python3 has no venv module (Debian: apt-get install python3-venv).
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="${CELERY_VENV:-target/celery-venv}"
if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
        echo "celery_bench: python3 has no venv/ensurepip module (Debian: apt-get install python3-venv)" >&2
        exit 3
    fi
    echo "celery_bench: creating virtualenv $venv" >&2
    python3 -m venv "$venv"
fi
# Quiet and near-instant once the requirements are met.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check 'celery>=5.4,<6' redis >&2

exec "$venv/bin/python" ops/bench/celery_bench.py "$@"
