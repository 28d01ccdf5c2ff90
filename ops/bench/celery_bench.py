"""Celery peer benchmark: the same no-op workload as fleet's bench, run through Celery.

Measured, against one Celery prefork worker on a fresh quorum queue:
  * burst: N no-op tasks published as fast as one producer connection allows; each task INCRs a
    Redis counter; tasks/s = N / (first publish -> counter == N).
  * idle: --idle tasks published one every 10 ms, each carrying its submit time; each task
    RPUSHes (start - submit) to a Redis list; p50/p99 in ms (nearest rank).
The last line, `CELERY_JSON {...}`, is what tests/src/bin/bench.rs parses.

The settings give Celery the guarantees fleet pays for, so the figures compare like with like:
  * quorum queue (durable, replicated log) and publisher confirms (confirm_publish): a task is
    on the broker's disk when its publish returns, as fleet's are;
  * task_acks_late: a task is acked after it ran, so a worker crash redelivers it (at least once);
  * worker_prefetch_multiplier=1: prefetch = 1 x concurrency, the in-flight bound of fleet's
    slots (quorum queues allow no global QoS: Celery then sets a per-consumer prefetch);
  * task_ignore_result: no result backend (fleet's no-op tasks store no result either).

Usage: celery_bench.py [--n 20000] [--idle 200] [--amqp URL] [--redis URL] [--concurrency 8]
Normally run through celery_bench.sh, which provides a virtualenv with celery and redis.
"""

import argparse
import ctypes
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RETRY = {"max_retries": 3, "interval_start": 0.5, "interval_step": 0.5}  # ~3 s to give up on the broker


def wait_until(what, timeout_s, cond, worker):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if worker.poll() is not None:
            raise RuntimeError(f"the Celery worker exited (code {worker.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def nearest_rank(sorted_values, p):
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


def worker_preexec():
    """The worker gets SIGTERM if the bench dies (even by SIGKILL): it must not outlive it."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_worker(worker):
    if worker.poll() is None:
        worker.terminate()  # warm shutdown
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            print("celery_bench: worker ignored SIGTERM for 30 s; SIGKILL", file=sys.stderr)
            os.killpg(worker.pid, signal.SIGKILL)  # its own session: the pool processes too
            worker.wait(10)


def run(args, app, tasks, r, keys, worker):
    incr, lat = tasks
    ready, counter, lats = keys
    with app.producer_or_acquire() as producer:  # one producer connection for every publish
        incr.apply_async((ready,), producer=producer)
        wait_until("the worker to run a first task", 120, lambda: r.exists(ready), worker)

        t0 = time.perf_counter()
        for _ in range(args.n):
            incr.apply_async((counter,), producer=producer)
        published_s = time.perf_counter() - t0
        wait_until(f"{args.n} burst tasks", max(120, args.n / 200), lambda: int(r.get(counter) or 0) >= args.n, worker)
        burst_s = time.perf_counter() - t0
        print(f"celery burst: {args.n} tasks in {burst_s:.2f} s = {args.n / burst_s:,.0f} tasks/s "
              f"(publishing took {published_s:.2f} s = {args.n / published_s:,.0f} msg/s)")

        t0 = time.monotonic()
        for i in range(args.idle):
            time.sleep(max(0.0, t0 + i * 0.010 - time.monotonic()))
            lat.apply_async((lats, time.time_ns()), producer=producer)
        wait_until(f"{args.idle} idle tasks", 60, lambda: r.llen(lats) >= args.idle, worker)
    ms = sorted(int(v) / 1e6 for v in r.lrange(lats, 0, -1))
    p50, p99 = nearest_rank(ms, 50), nearest_rank(ms, 99)
    print(f"celery idle: {args.idle} tasks 10 ms apart, submit->start p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    return burst_s, p50, p99


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--idle", type=int, default=200)
    ap.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/%2f")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    if args.n < 1 or args.idle < 1 or args.concurrency < 1:
        ap.error("--n, --idle and --concurrency must be >= 1")

    run_id = secrets.token_hex(6)
    queue = f"celerybench-{run_id}"
    os.environ.update(CELERYBENCH_QUEUE=queue, CELERYBENCH_AMQP=args.amqp, CELERYBENCH_REDIS=args.redis)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    import celery
    import redis
    from celery_app import app, incr, lat
    from kombu.exceptions import OperationalError
    from kombu.utils.url import maybe_sanitize_url

    r = redis.Redis.from_url(args.redis, socket_timeout=10)
    keys = [f"celerybench:{run_id}:{k}" for k in ("ready", "counter", "lat")]
    print(f"celery_bench: celery {celery.__version__}, queue {queue} (quorum), prefork -c {args.concurrency}, "
          f"n {args.n}, idle {args.idle}", file=sys.stderr)
    worker = declared = None
    try:
        try:
            r.ping()
        except redis.RedisError as e:
            raise RuntimeError(f"Redis at {args.redis} unreachable: {e}") from e
        try:
            with app.connection_for_write() as conn:
                conn.ensure_connection(**RETRY)
                app.amqp.queues[queue](conn.default_channel).declare()
                declared = True
        except (OSError, OperationalError) as e:
            raise RuntimeError(f"RabbitMQ at {maybe_sanitize_url(args.amqp)} unreachable: {e}") from e
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "-P", "prefork",
             "-c", str(args.concurrency), "-Q", queue, "-n", f"{queue}@%h", "--without-gossip",
             "--without-mingle", "--without-heartbeat", "-l", "warning"],
            cwd=HERE, env={**os.environ, "PYTHONPATH": HERE}, stdout=sys.stderr,
            start_new_session=True, preexec_fn=worker_preexec)
        burst_s, p50, p99 = run(args, app, (incr, lat), r, keys, worker)
    except Exception as e:  # noqa: BLE001 -- one clear line, then cleanup
        print(f"celery_bench: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            if worker is not None:
                stop_worker(worker)
        except Exception as e:  # noqa: BLE001
            print(f"celery_bench: could not stop the worker (pid {worker.pid}): {e}", file=sys.stderr)
        try:
            if declared:
                with app.connection_for_write() as conn:
                    conn.ensure_connection(**RETRY)
                    conn.default_channel.queue_delete(queue)
                    conn.default_channel.exchange_delete(queue)
        except Exception as e:  # noqa: BLE001
            print(f"celery_bench: could not delete queue {queue}: {e}", file=sys.stderr)
        try:
            if worker is not None:  # the keys appear only once the worker runs tasks
                r.delete(*keys)
        except Exception as e:  # noqa: BLE001
            print(f"celery_bench: could not delete Redis keys {keys}: {e}", file=sys.stderr)

    print("CELERY_JSON " + json.dumps({
        "tasks_per_s": round(args.n / burst_s, 1), "burst_s": round(burst_s, 3),
        "idle_p50_ms": round(p50, 3), "idle_p99_ms": round(p99, 3), "n": args.n, "idle_n": args.idle,
        "concurrency": args.concurrency, "celery_version": celery.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
