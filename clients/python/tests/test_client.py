"""The Python client against a real fleet (fleet_harness): real Redis, RabbitMQ, scheduler and
worker processes on a fresh namespace each. Exact counts; every wait has a timeout.

    python3 -m unittest discover -s clients/python/tests -v
"""

from __future__ import annotations

import ast
import os
import secrets
import subprocess
import sys
import time
import unittest
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet_client import (  # noqa: E402
    ApiError,
    Client,
    Refused,
    Task,
    TaskFailed,
    UnknownTask,
    WaitTimeout,
)
from fleet_harness import AMQP_URL, REPO, Fleet, Proc, metric_sum  # noqa: E402

WAIT = 30.0  # seconds any one task may take to end here


def poll(what: str, timeout: float, f: Callable[[], Any]) -> Any:
    end = time.monotonic() + timeout
    while True:
        v = f()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


class ClientTest(unittest.TestCase):
    """One scheduler (API tokens set) and one worker with 8 slots, shared by these tests."""

    fleet: Fleet
    admin: str
    reader: str
    client: Client
    worker: Proc

    @classmethod
    def setUpClass(cls) -> None:
        cls.admin = "adm" + secrets.token_hex(16)
        cls.reader = "rd" + secrets.token_hex(16)
        cls.fleet = Fleet()
        try:
            sched = cls.fleet.start_scheduler(
                {"FLEET_API_TOKENS": f"py-admin:{cls.admin} admin, py-read:{cls.reader} read"}
            )
            worker = cls.fleet.start_worker(capacity=8)
        except BaseException:
            cls.fleet.close()
            raise
        cls.worker = worker
        cls.client = Client(AMQP_URL, sched.url, cls.admin, namespace=cls.fleet.namespace)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.fleet.close()

    def succeeded_runs(self) -> float:
        return metric_sum(self.worker.metrics(), "fleet_tasks_completed_total", outcome="succeeded")

    def test_submit_then_wait_returns_the_echo_result(self) -> None:
        payload = {"hello": "fleet", "n": 1, "nested": {"a": [1, "x"]}}
        tid = self.client.submit("echo", payload, key="tenant-a", deadline=timedelta(seconds=60))
        self.assertIsInstance(tid, str)
        self.assertEqual(self.client.wait(tid, timeout=WAIT), payload)
        st = self.client.status(tid)
        self.assertEqual((st["state"], st["kind"], st["lane"]), ("succeeded", "echo", "normal"))
        # A chosen id is kept; the critical lane and a selector the worker satisfies (none).
        mine = "py-" + secrets.token_hex(6)
        self.assertEqual(self.client.submit("echo", [1, 2], id=mine, lane="critical"), mine)
        self.assertEqual(self.client.wait(mine, timeout=WAIT), [1, 2])
        self.assertEqual(self.client.status(mine)["lane"], "critical")
        # After close() the next submit opens a new connection.
        self.client.close()
        again = self.client.submit("echo", "again")
        self.assertEqual(self.client.wait(again, timeout=WAIT), "again")

    def test_submit_many_200_in_one_confirm_window_each_runs_once(self) -> None:
        before = self.succeeded_runs()
        events: List[Tuple[str, int]] = []
        self.client.submit("noop")  # opens the channel, so the window below is observable
        ch, conn = self.client._ch, self.client._conn
        real_publish, real_process = ch.basic_publish, conn.process_data_events

        def publish(*a: Any, **k: Any) -> Any:
            events.append(("publish", 0))
            return real_publish(*a, **k)

        def process(*a: Any, **k: Any) -> Any:
            events.append(("wait", 0))
            return real_process(*a, **k)

        ch.basic_publish, conn.process_data_events = publish, process
        try:
            tasks = [Task("echo", {"n": i}) for i in range(200)]
            ids = self.client.submit_many(tasks)
        finally:
            del ch.basic_publish, conn.process_data_events
        # Before the window, the client may read what the broker sent meanwhile (a liveness
        # check); then come the 200 publishes in a row, then the waits for their confirms.
        kinds = [e for e, _ in events]
        first = kinds.index("publish")
        self.assertLessEqual(first, 1, kinds[:5])
        self.assertEqual(kinds[first : first + 200], ["publish"] * 200, "all 200 published before any confirm is awaited")
        self.assertEqual(kinds.count("publish"), 200)
        self.assertEqual(set(kinds[first + 200 :]), {"wait"})
        self.assertEqual(len(ids), 200)
        self.assertEqual(len(set(ids)), 200)
        for i, tid in enumerate(ids):
            self.assertEqual(self.client.wait(tid, timeout=WAIT), {"n": i})
        for tid in ids:
            st = self.client.status(tid)
            self.assertEqual(st["state"], "succeeded")
            self.assertEqual(st.get("attempt"), 1, st)
            self.assertEqual([a["outcome"] for a in st["attempts"]], ["succeeded"], st)
        # The worker ran exactly 201 tasks meanwhile: the noop and the 200, none twice.
        poll("201 runs in the worker's metrics", 10, lambda: self.succeeded_runs() - before >= 201)
        time.sleep(0.5)
        self.assertEqual(self.succeeded_runs() - before, 201)

    def test_wait_raises_on_dead(self) -> None:
        tid = self.client.submit("fail", {}, max_attempts=1)
        with self.assertRaises(TaskFailed) as c:
            self.client.wait(tid, timeout=WAIT)
        self.assertEqual((c.exception.state, c.exception.reason), ("dead", "max_attempts"))
        self.assertIn("every attempt fails", c.exception.error or "")
        # A permanent error ends it at the first attempt although three are allowed.
        tid = self.client.submit("fail", {"times": 1, "permanent": True}, max_attempts=3)
        with self.assertRaises(TaskFailed) as c:
            self.client.wait(tid, timeout=WAIT)
        self.assertEqual((c.exception.state, c.exception.reason), ("dead", "permanent_error"))
        self.assertEqual(len(c.exception.status["attempts"]), 1, c.exception.status)

    def test_cancel_a_running_task_and_wait_raises_cancelled(self) -> None:
        tid = self.client.submit("sleep", {"ms": 60000})
        poll("the sleep task running", WAIT, lambda: self._state(tid) == "running")
        answer = self.client.cancel(tid, reason="python client test")
        self.assertEqual((answer["state"], answer["previous_state"]), ("cancelled", "running"))
        self.assertEqual(answer["cancelled_by"], "py-admin")
        started = time.monotonic()
        with self.assertRaises(TaskFailed) as c:
            self.client.wait(tid, timeout=WAIT)
        self.assertEqual(c.exception.state, "cancelled")
        self.assertLess(time.monotonic() - started, 5)
        again = self.client.cancel(tid)
        self.assertTrue(again.get("already"), again)
        # A task that ended cannot be cancelled: 409 finished.
        done = self.client.submit("noop")
        self.client.wait(done, timeout=WAIT)
        with self.assertRaises(ApiError) as e:
            self.client.cancel(done)
        self.assertEqual((e.exception.status, e.exception.code), (409, "finished"))

    def _state(self, tid: str) -> str:
        try:
            return str(self.client.status(tid)["state"])
        except UnknownTask:
            return ""

    def test_readme_example_runs_as_written(self) -> None:
        readme = (REPO / "README.md").read_text()
        marker = "<!-- python-client-example"
        self.assertIn(marker, readme)
        block = readme.split(marker, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
        api = self.fleet.scheduler.url if self.fleet.scheduler else ""
        env = {
            **os.environ,
            "FLEET_AMQP_URL": AMQP_URL,
            "FLEET_API_URL": api,
            "FLEET_API_TOKEN": self.admin,
            "FLEET_NAMESPACE": self.fleet.namespace,
            "PYTHONPATH": str(REPO / "clients" / "python"),
        }
        before = self.succeeded_runs()
        out = subprocess.run(
            [sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout, "{'n': 1}\n100 accepted\n")
        # Its echo and its 100 sleeps run, once each, before the other tests count runs.
        poll("the example's 101 runs", WAIT, lambda: self.succeeded_runs() - before >= 101)
        time.sleep(0.3)
        self.assertEqual(self.succeeded_runs() - before, 101)

    def test_readme_dag_example_runs_as_written(self) -> None:
        readme = (REPO / "README.md").read_text()
        marker = "<!-- python-dag-example"
        self.assertIn(marker, readme)
        block = readme.split(marker, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
        api = self.fleet.scheduler.url if self.fleet.scheduler else ""
        env = {
            **os.environ,
            "FLEET_AMQP_URL": AMQP_URL,
            "FLEET_API_URL": api,
            "FLEET_API_TOKEN": self.admin,
            "FLEET_NAMESPACE": self.fleet.namespace,
            "PYTHONPATH": str(REPO / "clients" / "python"),
        }
        before = self.succeeded_runs()
        out = subprocess.run(
            [sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[0], "waiting")
        self.assertEqual(
            ast.literal_eval(lines[1]),  # the printed dict
            {"step": "d", "parent_result": {"step": "b", "parent_result": {"rows": 3}}},
        )
        # Its four tasks ran, once each, before the other tests count runs.
        poll("the example's 4 runs", WAIT, lambda: self.succeeded_runs() - before >= 4)
        time.sleep(0.3)
        self.assertEqual(self.succeeded_runs() - before, 4)

    def test_a_batch_with_a_cycle_is_refused_and_after_needs_a_batch(self) -> None:
        run = secrets.token_hex(4)
        a, b = f"{run}-a", f"{run}-b"
        with self.assertRaises(ApiError) as c:
            self.client.submit_batch(
                [Task("echo", id=a, after=[b]), Task("echo", id=b, after=[a])], batch_id=run
            )
        self.assertEqual((c.exception.status, c.exception.code), (400, "cycle"))
        self.assertEqual(c.exception.body["cycle"], [a, b, a])
        with self.assertRaises(ApiError) as c:
            self.client.batch_status(run)
        self.assertEqual(c.exception.status, 404)
        with self.assertRaises(ValueError):
            self.client.submit_many([Task("echo", after=[a])])
        with self.assertRaises(ValueError):
            Task("echo", after=[a], payload_from=b).envelope()

    def test_publish_batch_over_amqp_counts_and_fires_on_complete_once(self) -> None:
        run = secrets.token_hex(4)
        before = self.succeeded_runs()
        ok = [Task("echo", {"i": i}, id=f"{run}-ok-{i}") for i in range(30)]
        bad = [Task("fail", {"times": 1, "permanent": True}, id=f"{run}-bad-{i}", max_attempts=3) for i in range(2)]
        # A waiting member (in the close, not published) taking the first member's result.
        child = Task("echo", {"child": True}, id=f"{run}-child", after=[ok[0].id or ""], payload_from=ok[0].id)
        done = Task("echo", {"which": "complete"})
        success = Task("echo", {"which": "success"})
        batch, ids = self.client.publish_batch(ok + bad + [child], on_success=success, on_complete=done, batch_id=run)
        self.assertEqual(batch, run)
        self.assertEqual(len(ids), 33)
        self.assertEqual(ids[-1], f"{run}-child")
        progress = poll(
            "the batch complete with on_complete fired",
            WAIT,
            lambda: (lambda p: p if p.get("complete") and p.get("fired") == ["on_complete"] else None)(
                self.client.batch_status(run)
            ),
        )
        self.assertEqual(progress["total"], 33)
        self.assertEqual(progress["succeeded"], 31)
        self.assertEqual(progress["dead"], 2)
        self.assertEqual(progress["failed"], [f"{run}-bad-0", f"{run}-bad-1"])
        result = self.client.wait(f"{run}:on_complete", timeout=WAIT)
        self.assertEqual(result["which"], "complete")
        self.assertEqual(result["batch"]["total"], 33)
        self.assertEqual(result["batch"]["succeeded"], 31)
        self.assertEqual(result["batch"]["failed"], [f"{run}-bad-0", f"{run}-bad-1"])
        child_result = self.client.wait(f"{run}-child", timeout=WAIT)
        self.assertEqual(child_result["parent_result"], {"i": 0})
        # Published again (a producer's retry): nothing runs twice, nothing fires again.
        self.client.publish_batch(ok + bad + [child], on_success=success, on_complete=done, batch_id=run)
        time.sleep(1.5)
        again = self.client.batch_status(run)
        self.assertEqual((again["total"], again["succeeded"], again["dead"]), (33, 31, 2))
        self.assertEqual(again["fired"], ["on_complete"])
        with self.assertRaises(UnknownTask):
            self.client.status(f"{run}:on_success")
        # The callback ran once (its attempts: one), and every member once: 30 + the child +
        # the callback succeeded.
        self.assertEqual(len(self.client.status(f"{run}:on_complete")["attempts"]), 1)
        poll("the batch's 32 successful runs", WAIT, lambda: self.succeeded_runs() - before >= 32)
        time.sleep(0.3)
        self.assertEqual(self.succeeded_runs() - before, 32)
        # Checked before anything is published.
        with self.assertRaises(ValueError):
            self.client.publish_batch([Task("echo", id=f"{run}-x", after=[f"{run}-y"])])
        with self.assertRaises(ValueError):
            self.client.publish_batch(
                [Task("echo", id=f"{run}-x", after=[f"{run}-y"]), Task("echo", id=f"{run}-y", after=[f"{run}-x"])]
            )

    def test_status_of_an_unknown_id(self) -> None:
        with self.assertRaises(UnknownTask) as c:
            self.client.status("never-submitted-" + secrets.token_hex(4))
        self.assertEqual((c.exception.status, c.exception.code), (404, "unknown_task"))
        started = time.monotonic()
        with self.assertRaises(WaitTimeout):
            self.client.wait("never-submitted-" + secrets.token_hex(4), timeout=0.5)
        self.assertLess(time.monotonic() - started, 3)

    def test_the_token_is_sent(self) -> None:
        tid = self.client.submit("noop")
        self.client.wait(tid, timeout=WAIT)
        api = self.fleet.scheduler.url if self.fleet.scheduler else ""
        ns = self.fleet.namespace
        with Client(AMQP_URL, api, None, namespace=ns) as anonymous:
            with self.assertRaises(ApiError) as c:
                anonymous.status(tid)
            self.assertEqual((c.exception.status, c.exception.code), (401, "unauthorized"))
        with Client(AMQP_URL, api, self.reader, namespace=ns) as reader:
            self.assertEqual(reader.status(tid)["state"], "succeeded")
            with self.assertRaises(ApiError) as c:
                reader.cancel(tid)
            self.assertEqual((c.exception.status, c.exception.code), (403, "forbidden"))

    def test_bad_arguments_are_refused_before_publishing(self) -> None:
        with self.assertRaises(ValueError):
            self.client.submit("echo", lane="urgent")
        with self.assertRaises(ValueError):
            self.client.submit("", {})
        with self.assertRaises(ValueError):
            self.client.submit("echo", not_before=datetime(2030, 1, 1))  # naive


class RefusalTest(unittest.TestCase):
    """A 5-deep ingress that nothing drains: the scheduler declared the namespace and stopped."""

    def test_a_full_ingress_refuses_with_the_reason_and_loses_nothing_accepted(self) -> None:
        fleet = Fleet({"FLEET_INGRESS_MAX_NORMAL": "5"})
        try:
            fleet.start_scheduler()
            fleet.stop_all()
            client = Client(AMQP_URL, "http://127.0.0.1:9", None, namespace=fleet.namespace)
            with client:
                tasks = [Task("echo", {"n": i}, id=f"{fleet.namespace}-{i}") for i in range(8)]
                with self.assertRaises(Refused) as c:
                    client.submit_many(tasks)
                r = c.exception
                self.assertEqual(r.reason, "ingress_full", r)
                self.assertEqual(r.accepted, [f"{fleet.namespace}-{i}" for i in range(5)])
                self.assertEqual(r.refused, [f"{fleet.namespace}-{i}" for i in range(5, 8)])
                self.assertEqual(r.depth, 5)
                self.assertIn(f"{fleet.namespace}.ingress.normal", r.detail)
                # One more, alone: refused too; the client goes on after a refusal.
                with self.assertRaises(Refused) as c:
                    client.submit("echo", {"n": 99}, id=f"{fleet.namespace}-99")
                self.assertEqual((c.exception.reason, c.exception.accepted), ("ingress_full", []))
            # The fleet comes back: the 5 accepted run, once each; the refused never existed.
            sched = fleet.start_scheduler()
            worker = fleet.start_worker(capacity=4)
            with Client(AMQP_URL, sched.url, None, namespace=fleet.namespace) as client:
                for i in range(5):
                    self.assertEqual(client.wait(f"{fleet.namespace}-{i}", timeout=WAIT), {"n": i})
                    st = client.status(f"{fleet.namespace}-{i}")
                    self.assertEqual([a["outcome"] for a in st["attempts"]], ["succeeded"])
                for i in (5, 6, 7, 99):
                    with self.assertRaises(UnknownTask):
                        client.status(f"{fleet.namespace}-{i}")
                m = worker.metrics()
                self.assertEqual(metric_sum(m, "fleet_tasks_completed_total", outcome="succeeded"), 5)
        finally:
            fleet.close()

    def test_a_namespace_without_a_scheduler_is_refused(self) -> None:
        ns = "pyclient-none-" + secrets.token_hex(4)
        with Client(AMQP_URL, "http://127.0.0.1:9", None, namespace=ns) as client:
            with self.assertRaises(Refused) as c:
                client.submit("echo", {})
            self.assertEqual(c.exception.reason, "no_namespace")
            self.assertEqual(len(c.exception.refused), 1)
            # The client opens a new channel for the next call.
            with self.assertRaises(Refused) as c:
                client.submit_many([Task("echo"), Task("echo")])
            self.assertEqual((c.exception.reason, len(c.exception.refused)), ("no_namespace", 2))


if __name__ == "__main__":
    unittest.main()
