"""Publish fleet tasks from Python with pika (pip install pika).

Usage: python3 examples/publish.py [count]   (FLEET_AMQP_URL / FLEET_NAMESPACE as for fleet)
Exits 1 if the broker refused any task (the fleet is full: retry later), 2 if the namespace
has no submit exchange yet (no scheduler has run in it: start one first).
"""
import json
import os
import sys
import uuid

import pika

url = os.environ.get("FLEET_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
ns = os.environ.get("FLEET_NAMESPACE", "fleet")
count = int(sys.argv[1]) if len(sys.argv) > 1 else 10

conn = pika.BlockingConnection(pika.URLParameters(url))
ch = conn.channel()
ch.confirm_delivery()  # publisher confirms: a full ingress queue answers with a nack

accepted = refused = 0
for i in range(count):
    task = {
        "id": str(uuid.uuid4()),           # idempotency key (optional)
        "kind": "echo",                    # handler name
        "payload": {"n": i, "from": "python"},
        "labels": {"gpu": "false"},        # selector: runs only where gpu=false
        "timeout_ms": 60000,               # or "deadline": "2026-12-01T10:00:00Z"
        "max_attempts": 3,
    }
    try:
        ch.basic_publish(
            exchange=f"{ns}.submit",
            routing_key="normal",          # the lane: normal | critical
            body=json.dumps(task),
            properties=pika.BasicProperties(content_type="application/json", delivery_mode=2),
            mandatory=True,
        )
        accepted += 1
    except (pika.exceptions.NackError, pika.exceptions.UnroutableError):
        refused += 1
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code == 404:
            # The exchange does not exist: no scheduler has ever started in this namespace
            # (the scheduler declares `<ns>.submit` and the ingress queues at start-up).
            print(f"exchange {ns}.submit not found: start fleet-scheduler with FLEET_NAMESPACE={ns} "
                  f"first (or set FLEET_NAMESPACE to the namespace your fleet uses)", file=sys.stderr)
            sys.exit(2)
        raise

conn.close()
print(f"accepted={accepted} refused={refused}")
sys.exit(1 if refused else 0)
