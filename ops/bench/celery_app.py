"""Celery app of the peer benchmark (ops/bench/celery_bench.py), imported by the bench and its worker.

Configured by environment: CELERYBENCH_QUEUE (queue name, fresh per run), CELERYBENCH_AMQP
(broker URL), CELERYBENCH_REDIS (Redis URL the tasks write to). Settings and their reasons are
in celery_bench.py's docstring.
"""

import os
import time

import redis
from celery import Celery
from celery.worker.consumer import Consumer
from kombu import Queue

QUEUE = os.environ["CELERYBENCH_QUEUE"]


class BenchConsumer(Consumer):
    """The stock consumer without the native-delayed-delivery step.

    With quorum queues, Celery >= 5.5 declares 28 permanent `celery_delayed_*` quorum queues
    and exchanges on the broker for ETA/countdown tasks; the bench sends none, and must leave
    nothing behind on a broker it shares.
    """

    class Blueprint(Consumer.Blueprint):
        default_steps = [s for s in Consumer.Blueprint.default_steps if not s.endswith(":DelayedDelivery")]


app = Celery("celery_app", broker=os.environ["CELERYBENCH_AMQP"])
app.conf.update(
    task_queues=[Queue(QUEUE, routing_key=QUEUE, durable=True, queue_arguments={"x-queue-type": "quorum"})],
    task_default_queue=QUEUE,  # the default exchange is then a durable direct exchange of that name
    broker_transport_options={"confirm_publish": True},
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    worker_enable_remote_control=False,  # no pidbox queue: nothing else on the broker
    worker_consumer="celery_app:BenchConsumer",
)

_redis = None


def _r():
    global _redis
    if _redis is None:  # one connection per worker process, made after the fork
        _redis = redis.Redis.from_url(os.environ["CELERYBENCH_REDIS"])
    return _redis


@app.task(name="bench.incr")
def incr(key):
    _r().incr(key)


@app.task(name="bench.lat")
def lat(key, submit_ns):
    start_ns = time.time_ns()
    _r().rpush(key, start_ns - submit_ns)
