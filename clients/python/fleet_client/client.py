"""The fleet client: submit over AMQP with publisher confirms, status/wait/cancel over HTTP.

Only pika (AMQP) and the standard library (urllib.request for the scheduler's API).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import pika
import pika.exceptions

__all__ = [
    "Client",
    "Task",
    "FleetError",
    "Refused",
    "Unconfirmed",
    "ApiError",
    "UnknownTask",
    "TaskFailed",
    "WaitTimeout",
    "TERMINAL_STATES",
    "FAILED_STATES",
    "BATCH_CLOSE_TYPE",
    "MAX_BATCH_TASKS",
]

#: States after which a task never changes again (GET /v1/tasks/{id}).
TERMINAL_STATES = frozenset({"succeeded", "dead", "expired", "cancelled"})
#: Terminal states that are not a success: `wait` raises `TaskFailed` on them.
FAILED_STATES = frozenset({"dead", "expired", "cancelled"})
LANES = ("normal", "critical")
#: The AMQP ``type`` of a batch's closing message (`Client.publish_batch`).
BATCH_CLOSE_TYPE = "fleet.batch.close"
#: Most tasks in one batch.
MAX_BATCH_TASKS = 20_000

Labels = Union[Mapping[str, str], str, None]
When = Union[datetime, timedelta, None]
Deadline = Union[datetime, timedelta, float, int, None]


class FleetError(Exception):
    """Base of every error this client raises."""


class Refused(FleetError):
    """The fleet refused one or more tasks; nothing refused was taken, every id in `accepted` was.

    `reason` is a bounded word:

    * ``ingress_full`` — RabbitMQ nacked the publish: the namespace's bounded ingress queue for
      the lane is at its bound (``FLEET_INGRESS_MAX_NORMAL`` / ``_CRITICAL``): the fleet is
      behind, retry later. ``depth`` is the queue's depth read just after the nack.
    * ``broker_unavailable`` — RabbitMQ nacked the publish while the ingress queue was empty
      (a quorum queue without a leader after a node loss): retry shortly.
    * ``no_route`` — the broker returned the message as unroutable: the lane has no ingress
      queue bound (no scheduler has declared this namespace).
    * ``no_namespace`` — the exchange ``<ns>.submit`` does not exist: no scheduler has ever
      started with this ``FLEET_NAMESPACE``.
    * from ``POST`` answers of the scheduler's API (429/503): its ``error`` word.

    Submitting a refused task again with the same id is safe (a copy already taken is
    dropped as a duplicate).
    """

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        accepted: Sequence[str] = (),
        refused: Sequence[str] = (),
        retry_after: Optional[float] = None,
        depth: Optional[int] = None,
    ) -> None:
        self.reason = reason
        self.detail = detail
        self.accepted: List[str] = list(accepted)
        self.refused: List[str] = list(refused)
        self.retry_after = retry_after
        self.depth = depth
        super().__init__(
            f"{reason}: {detail} ({len(self.refused)} refused, {len(self.accepted)} accepted)"
        )


class Unconfirmed(FleetError):
    """The broker neither confirmed nor refused some tasks (the connection was lost, or no
    confirm came within `confirm_timeout`). Those in `unknown` may or may not have been taken:
    submitting them again with the same ids is safe, with new ids it is not."""

    def __init__(self, detail: str, *, accepted: Sequence[str], unknown: Sequence[str]) -> None:
        self.detail = detail
        self.accepted: List[str] = list(accepted)
        self.unknown: List[str] = list(unknown)
        super().__init__(f"{detail} ({len(self.unknown)} unconfirmed, {len(self.accepted)} accepted)")


class ApiError(FleetError):
    """The scheduler's HTTP API answered with an error: `status` (HTTP), `code` (its `error`
    word, e.g. ``unauthorized``, ``forbidden``, ``finished``) and `detail`."""

    def __init__(self, status: int, code: str, detail: str, body: Optional[Dict[str, Any]] = None) -> None:
        self.status = status
        self.code = code
        self.detail = detail
        self.body: Dict[str, Any] = body or {}
        super().__init__(f"HTTP {status} {code}: {detail}")


class UnknownTask(ApiError):
    """404 ``unknown_task``: no status record for the id (never seen, not reached the scheduler
    yet, or older than the status TTL)."""


class TaskFailed(FleetError):
    """`wait` saw the task end without success: `state` is ``dead``, ``expired`` or
    ``cancelled``; `reason` and `error` as the status has them; `status` the whole record."""

    def __init__(self, task_id: str, status: Dict[str, Any]) -> None:
        self.id = task_id
        self.status = status
        self.state: str = str(status.get("state", ""))
        self.reason: Optional[str] = _opt_str(status.get("reason") or status.get("cancel_reason"))
        self.error: Optional[str] = _opt_str(status.get("error"))
        why = ", ".join(x for x in (self.reason, self.error) if x)
        super().__init__(f"task {task_id} {self.state}" + (f": {why}" if why else ""))


class WaitTimeout(FleetError, TimeoutError):
    """`wait` ran out of time before the task ended; `status` is the last record seen (None
    when the scheduler had none yet)."""

    def __init__(self, task_id: str, timeout: float, status: Optional[Dict[str, Any]]) -> None:
        self.id = task_id
        self.status = status
        state = status.get("state") if status else "unknown to the scheduler"
        super().__init__(f"task {task_id} did not end within {timeout:g} s (last state: {state})")


def _opt_str(v: Any) -> Optional[str]:
    return None if v is None else str(v)


def _rfc3339(t: datetime) -> str:
    if t.tzinfo is None:
        raise ValueError("datetimes must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Task:
    """One task for `Client.submit_many`, `Client.submit_batch` or `Client.publish_batch`; the
    fields are `Client.submit`'s arguments, and for the batches only: `after`, the ids of other tasks
    of the same batch that must all succeed before this one runs (it ends dead with reason
    ``dependency_failed`` when one of them does not), and `payload_from`, one of those ids
    whose result this task's payload gets under ``parent_result``."""

    kind: str
    payload: Any = None
    labels: Labels = None
    key: Optional[str] = None
    lane: str = "normal"
    not_before: When = None
    deadline: Deadline = None
    id: Optional[str] = None
    max_attempts: Optional[int] = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    after: Sequence[str] = ()
    payload_from: Optional[str] = None

    def envelope(self, now: Optional[datetime] = None) -> Dict[str, Any]:
        """The JSON envelope (README "Publishing a task"), with an id generated when absent."""
        if not isinstance(self.kind, str) or not self.kind.strip():
            raise ValueError("kind must be a non-empty string")
        if self.lane not in LANES:
            raise ValueError(f"unknown lane {self.lane!r} (use normal or critical)")
        now = now or datetime.now(timezone.utc)
        env: Dict[str, Any] = dict(self.extra)
        env["id"] = self.id if self.id is not None else str(uuid.uuid4())
        env["kind"] = self.kind
        env["payload"] = self.payload
        if self.labels:
            env["labels"] = self.labels if isinstance(self.labels, str) else dict(self.labels)
        env["lane"] = self.lane
        if self.key is not None:
            # The fairness key (README "Tenants"): the scheduler shares capacity between keys
            # and holds each to its limits; at most 64 bytes.
            env["key"] = self.key
        if self.not_before is not None:
            nb = now + self.not_before if isinstance(self.not_before, timedelta) else self.not_before
            env["not_before"] = _rfc3339(nb)
        if self.deadline is not None:
            if isinstance(self.deadline, datetime):
                env["deadline"] = _rfc3339(self.deadline)
            else:
                secs = (
                    self.deadline.total_seconds()
                    if isinstance(self.deadline, timedelta)
                    else float(self.deadline)
                )
                if secs <= 0:
                    raise ValueError("a relative deadline must be positive")
                env["timeout_ms"] = max(1, int(round(secs * 1000)))
        if self.max_attempts is not None:
            env["max_attempts"] = self.max_attempts
        if isinstance(self.after, str):
            raise ValueError("after must be a list of task ids, not a string")
        if self.after:
            env["after"] = [str(a) for a in self.after]
        if self.payload_from is not None:
            if self.payload_from not in self.after:
                raise ValueError("payload_from must be one of the after ids")
            env["payload_from"] = self.payload_from
        return env


@dataclass
class _Pending:
    id: str
    lane: str
    returned: bool = False


class Client:
    """A fleet client.

    ``Client(amqp_url, api_url, token)``: tasks are published over AMQP to ``<namespace>.submit``
    with publisher confirms; ``status``, ``wait`` and ``cancel`` use the scheduler's HTTP API
    (``api_url``, e.g. ``http://127.0.0.1:8080``) with ``Authorization: Bearer <token>`` when a
    token is given (``submit`` needs none: AMQP has its own credentials in ``amqp_url``).

    Not thread-safe (pika's blocking connection is not): use one client per thread. The AMQP
    connection opens on the first submit and again after it was lost; ``close()`` (or ``with``)
    ends it.
    """

    def __init__(
        self,
        amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/%2f",
        api_url: str = "http://127.0.0.1:8080",
        token: Optional[str] = None,
        *,
        namespace: str = "fleet",
        confirm_timeout: float = 30.0,
        http_timeout: float = 10.0,
    ) -> None:
        self.amqp_url = amqp_url
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.namespace = namespace
        self.confirm_timeout = confirm_timeout
        self.http_timeout = http_timeout
        self._conn: Any = None  # pika.BlockingConnection (pika ships no type hints)
        self._ch: Any = None  # its pika.channel.Channel in confirm mode
        self._blocking_ch: Any = None  # the pika.BlockingChannel that owns self._ch
        self._acks: Dict[int, bool] = {}  # delivery tag -> acked (False: nacked)
        self._outstanding: Set[int] = set()  # published, not yet acked or nacked
        self._returned: List[str] = []  # message ids returned as unroutable
        self._closed_reason: Optional[Exception] = None
        self._next_tag = 1

    # ------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the AMQP connection (if open)."""
        conn, self._conn, self._ch = self._conn, None, None
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except (pika.exceptions.AMQPError, OSError):
                pass

    # ------------------------------------------------------------------------ submitting

    def submit(
        self,
        kind: str,
        payload: Any = None,
        *,
        labels: Labels = None,
        key: Optional[str] = None,
        lane: str = "normal",
        not_before: When = None,
        deadline: Deadline = None,
        id: Optional[str] = None,
        max_attempts: Optional[int] = None,
        extra: Optional[Mapping[str, Any]] = None,
    ) -> str:
        """Submits one task and returns its id once the broker confirmed it.

        `labels`: the selector (``{"gpu": "true"}`` or ``"gpu=true,zone=a"``). `lane`:
        ``normal`` or ``critical``. `not_before`: a timezone-aware datetime, or a timedelta
        from now. `deadline`: a timezone-aware datetime (absolute), or a timedelta / seconds
        (relative: ``timeout_ms``). `id`: the idempotency key (a uuid4 when None). `key`: the
        fairness key (sent only when given). `extra`: more envelope fields (``protocol``,
        ``strategy``...).

        Raises `Refused` (with the reason) when the fleet did not take it, `Unconfirmed` when
        the broker's answer was lost.
        """
        task = Task(
            kind=kind,
            payload=payload,
            labels=labels,
            key=key,
            lane=lane,
            not_before=not_before,
            deadline=deadline,
            id=id,
            max_attempts=max_attempts,
            extra=dict(extra or {}),
        )
        return self.submit_many([task])[0]

    def submit_many(self, tasks: Iterable[Task]) -> List[str]:
        """Submits every task in one confirm window: all are published, then the broker's
        confirms are awaited together. Returns the ids, in order, when every one was taken.

        Raises `Refused` when any was refused — its `accepted` ids were taken and will run, its
        `refused` ids were not — and `Unconfirmed` when some answers were lost.
        """
        now = datetime.now(timezone.utc)
        envs = [t.envelope(now) for t in tasks]
        if any("after" in e for e in envs):
            raise ValueError(
                "after and payload_from work only in submit_batch and publish_batch (a task's"
                " parents are members of its batch)"
            )
        return self._publish([(e["id"], e["lane"], e, None) for e in envs])

    def _publish(self, msgs: Sequence[Tuple[str, str, Dict[str, Any], Optional[str]]]) -> List[str]:
        """Publishes `msgs` — (message id, lane, JSON body, AMQP `type` or None) — to
        ``<namespace>.submit`` in one confirm window; the ids, in order, when all were taken.
        Raises `Refused` / `Unconfirmed` as `submit_many` does."""
        if not msgs:
            return []
        self._ensure_channel()
        exchange = f"{self.namespace}.submit"
        first = self._next_tag
        pending: Dict[int, _Pending] = {}
        ts = int(time.time())
        try:
            for mid, lane, doc, kind in msgs:
                props = pika.BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    message_id=mid,
                    timestamp=ts,
                    type=kind,
                )
                body = json.dumps(doc, separators=(",", ":")).encode()
                self._ch.basic_publish(exchange, lane, body, props, mandatory=True)
                pending[self._next_tag] = _Pending(mid, lane)
                self._outstanding.add(self._next_tag)
                self._next_tag += 1
            deadline = time.monotonic() + self.confirm_timeout
            last = self._next_tag - 1
            while not all(t in self._acks for t in range(first, last + 1)):
                if self._closed_reason is not None or not self._conn.is_open:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._conn.process_data_events(time_limit=min(left, 0.2))
        except (pika.exceptions.AMQPError, OSError) as e:
            self._closed_reason = self._closed_reason or e
        return self._settle([m[0] for m in msgs], pending, first)

    def _settle(self, ids: List[str], pending: Dict[int, _Pending], first: int) -> List[str]:
        # Returns arrive before the ack of the same message: mark them on the oldest pending
        # message with that id.
        for mid in self._returned:
            for tag in sorted(pending):
                r = pending[tag]
                if r.id == mid and not r.returned:
                    r.returned = True
                    break
        self._returned.clear()
        accepted: List[str] = []
        nacked: List[_Pending] = []
        unroutable: List[str] = []
        unknown: List[str] = []
        for tag in range(first, first + len(ids)):
            p = pending.get(tag)
            if p is None:  # never published (the channel went first)
                unknown.append(ids[tag - first])
                continue
            ok = self._acks.pop(tag, None)
            self._outstanding.discard(tag)
            if ok is None:
                unknown.append(p.id)
            elif not ok:
                nacked.append(p)
            elif p.returned:
                unroutable.append(p.id)
            else:
                accepted.append(p.id)
        closed = self._closed_reason
        if closed is not None:
            self._drop_channel()
        if isinstance(closed, pika.exceptions.ChannelClosedByBroker) and closed.reply_code == 404:
            raise Refused(
                "no_namespace",
                f"exchange {self.namespace}.submit not found: no scheduler has run with "
                f"FLEET_NAMESPACE={self.namespace} ({closed.reply_text})",
                accepted=accepted,
                refused=[p.id for p in nacked] + unroutable + unknown,
            )
        if unknown:
            why = f"connection lost: {closed}" if closed else f"no confirm within {self.confirm_timeout:g} s"
            raise Unconfirmed(why, accepted=accepted, unknown=unknown)
        if nacked:
            lanes = sorted({p.lane for p in nacked})
            depth = self._ingress_depth(lanes[0])
            refused = [p.id for p in nacked] + unroutable
            queue = f"{self.namespace}.ingress.{lanes[0]}"
            if depth == 0:
                raise Refused(
                    "broker_unavailable",
                    f"RabbitMQ nacked the publish with {queue} empty (a queue without a leader?); retry shortly",
                    accepted=accepted,
                    refused=refused,
                    retry_after=1.0,
                    depth=depth,
                )
            raise Refused(
                "ingress_full",
                f"the ingress queue {queue} is at its bound (depth {depth if depth is not None else '?'}): "
                "the fleet is behind; retry later",
                accepted=accepted,
                refused=refused,
                retry_after=1.0,
                depth=depth,
            )
        if unroutable:
            raise Refused(
                "no_route",
                f"unroutable: no ingress queue is bound to {self.namespace}.submit for this lane "
                "(has a scheduler declared the namespace?)",
                accepted=accepted,
                refused=unroutable,
            )
        return accepted

    def _ingress_depth(self, lane: str) -> Optional[int]:
        """The ingress queue's depth (a passive declare on a channel of its own), None when it
        cannot be read."""
        if self._conn is None or not self._conn.is_open:
            return None
        try:
            ch = self._conn.channel()
            try:
                ok = ch.queue_declare(f"{self.namespace}.ingress.{lane}", passive=True)
                return int(ok.method.message_count)
            finally:
                if ch.is_open:
                    ch.close()
        except (pika.exceptions.AMQPError, OSError):
            return None

    def _ensure_channel(self) -> None:
        if self._conn is not None and self._conn.is_open:
            try:
                # Reads what the broker sent meanwhile (heartbeats, a close): finds a dead
                # connection before publishing on it.
                self._conn.process_data_events(time_limit=0)
            except (pika.exceptions.AMQPError, OSError):
                self.close()
        if self._conn is None or not self._conn.is_open:
            self._drop_channel()
            self._conn = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
        if self._ch is None or not self._ch.is_open:
            self._open_confirm_channel()

    def _open_confirm_channel(self) -> None:
        # pika's BlockingChannel waits for each confirm before the next publish; a window needs
        # the underlying asynchronous channel (BlockingChannel._impl, pika 1.x), driven by the
        # blocking connection's process_data_events.
        blocking = self._conn.channel()
        ch = blocking._impl
        self._acks = {}
        self._outstanding = set()
        self._returned = []
        self._closed_reason = None
        self._next_tag = 1
        done: List[bool] = []
        ch.confirm_delivery(ack_nack_callback=self._on_confirm, callback=lambda _f: done.append(True))
        ch.add_on_return_callback(self._on_return)
        ch.add_on_close_callback(self._on_channel_closed)
        deadline = time.monotonic() + self.confirm_timeout
        while not done:
            if time.monotonic() > deadline:
                raise Unconfirmed("confirm.select was not answered", accepted=[], unknown=[])
            self._conn.process_data_events(time_limit=0.1)
        self._blocking_ch = blocking  # keeps the wrapper (and its callbacks) alive
        self._ch = ch

    def _drop_channel(self) -> None:
        ch, self._ch = self._ch, None
        if ch is not None and ch.is_open:
            try:
                ch.close()
            except (pika.exceptions.AMQPError, OSError):
                pass
        if self._conn is not None and not self._conn.is_open:
            self._conn = None

    def _on_confirm(self, frame: Any) -> None:
        m = frame.method
        ok = isinstance(m, pika.spec.Basic.Ack)
        tag = int(m.delivery_tag)
        tags = [t for t in self._outstanding if t <= tag] if m.multiple else [tag]
        for t in tags:
            if t in self._outstanding:
                self._outstanding.discard(t)
                self._acks[t] = ok

    def _on_return(self, _ch: Any, _method: Any, props: Any, _body: bytes) -> None:
        self._returned.append(str(props.message_id))

    def _on_channel_closed(self, _ch: Any, reason: Exception) -> None:
        self._closed_reason = reason

    # ------------------------------------------------------------------------ the HTTP API

    def _request(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Tuple[int, Dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.api_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.http_timeout) as r:
                return int(r.status), _json_object(r.read())
        except urllib.error.HTTPError as e:
            status, doc = int(e.code), _json_object(e.read())
            code = str(doc.get("error", "http_error"))
            detail = str(doc.get("detail", e.reason))
            if status == 404 and code == "unknown_task":
                raise UnknownTask(status, code, detail, doc) from None
            raise ApiError(status, code, detail, doc) from None

    def status(self, task_id: str) -> Dict[str, Any]:
        """``GET /v1/tasks/{id}``: the status record (``state``, ``result``, ``error``,
        ``reason``, ``attempts``...; see shared/schema/status.schema.json). Raises
        `UnknownTask` for an id the scheduler has no record of."""
        _, doc = self._request("GET", "/v1/tasks/" + urllib.parse.quote(task_id, safe=""))
        return doc

    def wait(self, task_id: str, timeout: float, *, poll: float = 0.05) -> Any:
        """Waits until the task ends and returns its result (``status["result"]``: any JSON;
        a string when fleet cut it at 4096 bytes, ``result_truncated`` then true).

        Raises `TaskFailed` when it ended dead, expired or cancelled, and `WaitTimeout` after
        `timeout` seconds (a task the scheduler has no record of yet is waited for too: a
        submitted task is recorded once the scheduler takes it from the ingress).
        """
        end = time.monotonic() + timeout
        last: Optional[Dict[str, Any]] = None
        delay = poll
        while True:
            try:
                last = self.status(task_id)
            except UnknownTask:
                pass
            if last is not None:
                state = last.get("state")
                if state == "succeeded":
                    return last.get("result")
                if state in FAILED_STATES:
                    raise TaskFailed(task_id, last)
            left = end - time.monotonic()
            if left <= 0:
                raise WaitTimeout(task_id, timeout, last)
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, 1.0)

    def cancel(self, task_id: str, reason: str = "") -> Dict[str, Any]:
        """``POST /v1/tasks/{id}/cancel`` (role admin when tokens are set): returns the answer
        (``state`` cancelled, ``previous_state``; ``already`` true when it was cancelled before).
        Raises `ApiError` ``finished`` (409) when it had ended, `UnknownTask` (404)."""
        path = "/v1/tasks/" + urllib.parse.quote(task_id, safe="") + "/cancel"
        _, doc = self._request("POST", path, {"reason": reason})
        return doc

    def submit_batch(
        self,
        tasks: Iterable[Task],
        *,
        on_success: Optional[Task] = None,
        on_complete: Optional[Task] = None,
        batch_id: Optional[str] = None,
    ) -> Tuple[str, List[str]]:
        """``POST /v1/batches`` (role submit when tokens are set): submits `tasks` as one batch
        and returns ``(batch_id, task_ids)``. ``on_success`` runs once when every task
        succeeded, ``on_complete`` once when every task ended (whatever the outcome); each
        gets the batch's figures in its payload under ``batch`` (``total``, ``succeeded``,
        ``dead``, ``expired``, ``cancelled``, ``failed``: the ids that did not succeed).

        Chains and DAGs: a task with ``after=[ids]`` (give its parents explicit ids) waits,
        holding no worker and no queue, until every one of them succeeded, then runs; it ends
        dead with reason ``dependency_failed`` when one of them ends otherwise. With
        ``payload_from=id`` (one of its ``after``) its payload gets that parent's result under
        ``parent_result`` (merged into a dict payload; any other payload is kept under
        ``value``). A waiting task's `status` is ``waiting`` (with ``after``).

        Goes through the HTTP API (the batch's definition is recorded before any task is
        published). Raises `ApiError` on 400 (``index`` in ``body`` names the bad task, -1 a
        callback; ``code`` ``cycle`` with ``body["cycle"]`` naming the ids around a cycle,
        ``unknown_dependency``, ``self_dependency``...) and `Refused` on 429/503: submitting
        the same batch again with the same ``batch_id`` and task ids is safe (copies already
        taken are duplicates)."""
        now = datetime.now(timezone.utc)
        body: Dict[str, Any] = {"tasks": [t.envelope(now) for t in tasks]}
        if batch_id is not None:
            body["id"] = batch_id
        for name, cb in (("on_success", on_success), ("on_complete", on_complete)):
            if cb is not None:
                env = cb.envelope(now)
                env.pop("id", None)  # the callback's id is `<batch>:<name>`
                body[name] = env
        try:
            _, doc = self._request("POST", "/v1/batches", body)
        except ApiError as e:
            if e.status in (429, 503):
                raise Refused(
                    e.code,
                    e.detail,
                    accepted=[str(i) for i in e.body.get("accepted", [])],
                    refused=[str(i) for i in e.body.get("refused", [])],
                ) from None
            raise
        return str(doc.get("batch", "")), [str(i) for i in doc.get("ids", [])]

    def publish_batch(
        self,
        tasks: Iterable[Task],
        *,
        on_success: Optional[Task] = None,
        on_complete: Optional[Task] = None,
        batch_id: Optional[str] = None,
    ) -> Tuple[str, List[str]]:
        """Submits `tasks` as one batch over AMQP alone (no HTTP API needed) and returns
        ``(batch_id, task_ids)``; the callbacks, ``after`` and ``payload_from`` work as in
        `submit_batch`.

        The members without ``after`` are published like `submit_many` (one confirm window),
        each with ``"batch": batch_id``; then, once every one was confirmed, the batch's
        closing message (AMQP ``type`` ``fleet.batch.close``, message id ``<batch_id>:close``)
        listing their ids and carrying the envelopes of the members with ``after`` (they wait
        in the batch's definition, not in a queue). The scheduler records the definition
        before it takes the close. A parent named in a ``payload_from`` is published with
        ``pass_result`` set (the worker keeps its result for the child).

        The batch is checked here first (``ValueError``: no task, more than 20,000, an
        ``after`` naming a task not in the batch or itself, a cycle), since a close the
        scheduler refuses goes to the dead-letter queue (reason ``bad_batch``) where this call
        cannot see it.

        Raises `Refused` when members were refused — no close was sent; its ``refused`` names
        them — or when the close itself was (``refused`` is ``["<batch_id>:close"]``, every
        member in ``accepted``), and `Unconfirmed` when answers were lost. Calling it again
        with the same ``batch_id`` and task ids is safe: members already taken are dropped as
        duplicates, and a repeated close changes nothing.
        """
        now = datetime.now(timezone.utc)
        batch = batch_id if batch_id is not None else str(uuid.uuid4())
        if not batch or len(batch.encode()) > 128:
            raise ValueError("batch_id must be 1 to 128 bytes")
        envs = [t.envelope(now) for t in tasks]
        if not envs:
            raise ValueError("a batch needs at least one task")
        if len(envs) > MAX_BATCH_TASKS:
            raise ValueError(f"a batch holds at most {MAX_BATCH_TASKS} tasks")
        _check_dag(envs)
        parents = {e["payload_from"] for e in envs if "payload_from" in e}
        for e in envs:
            e["batch"] = batch
            if e["id"] in parents:
                e["pass_result"] = True
        members = [e for e in envs if "after" not in e]
        self._publish([(e["id"], e["lane"], e, None) for e in members])
        close: Dict[str, Any] = {
            "id": batch,
            "tasks": [e if "after" in e else e["id"] for e in envs],
        }
        for name, cb in (("on_success", on_success), ("on_complete", on_complete)):
            if cb is not None:
                env = cb.envelope(now)
                env.pop("id", None)  # the callback's id is `<batch>:<name>`
                close[name] = env
        close_id = f"{batch}:close"
        try:
            self._publish([(close_id, "normal", close, BATCH_CLOSE_TYPE)])
        except Refused as r:
            raise Refused(
                r.reason,
                f"the members were taken but the batch's close was not: {r.detail}; publish the "
                "batch again with the same batch_id and ids",
                accepted=[e["id"] for e in members],
                refused=[close_id],
                retry_after=r.retry_after,
                depth=r.depth,
            ) from None
        except Unconfirmed as u:
            raise Unconfirmed(
                f"the batch's close was not confirmed: {u.detail}",
                accepted=[e["id"] for e in members],
                unknown=[close_id],
            ) from None
        return batch, [str(e["id"]) for e in envs]

    def batch_status(self, batch_id: str) -> Dict[str, Any]:
        """``GET /v1/batches/{id}``: ``total``, ``succeeded``, ``dead``, ``expired``,
        ``cancelled``, ``pending``, ``waiting`` (ids waiting for their ``after``),
        ``failed`` (ids), ``fired`` (callbacks published), ``complete``. Raises `ApiError`
        ``unknown_batch`` (404)."""
        _, doc = self._request("GET", "/v1/batches/" + urllib.parse.quote(batch_id, safe=""))
        return doc


def _check_dag(envs: List[Dict[str, Any]]) -> None:
    """Raises ValueError when the ``after`` links of a batch's envelopes are not a DAG over its
    members (an unknown id, itself, a duplicate task id among linked ones, a cycle)."""
    ids = [str(e["id"]) for e in envs]
    linked = [e for e in envs if "after" in e]
    if not linked:
        return
    if len(set(ids)) != len(ids):
        raise ValueError("task ids must be unique in a batch with after links")
    known = set(ids)
    parents: Dict[str, List[str]] = {}
    for e in linked:
        for a in e["after"]:
            if a not in known:
                raise ValueError(f"task {e['id']}: after names {a}, which is not a task of this batch")
            if a == e["id"]:
                raise ValueError(f"task {e['id']} names itself in after")
        parents[str(e["id"])] = [str(a) for a in e["after"]]
    # Depth-first: a task met again while still on the path closes a cycle.
    state: Dict[str, int] = {}  # 1: on the path, 2: done
    for start in parents:
        stack: List[Tuple[str, int]] = [(start, 0)]
        while stack:
            node, k = stack.pop()
            if k == 0:
                if state.get(node) == 2:
                    continue
                state[node] = 1
            ps = parents.get(node, [])
            if k < len(ps):
                stack.append((node, k + 1))
                nxt = ps[k]
                if state.get(nxt) == 1:
                    raise ValueError(f"the after links make a cycle through {nxt}")
                if state.get(nxt) != 2:
                    stack.append((nxt, 0))
            else:
                state[node] = 2


def _json_object(raw: bytes) -> Dict[str, Any]:
    try:
        v = json.loads(raw) if raw else {}
    except ValueError:
        return {"error": "not_json", "detail": raw[:200].decode("utf-8", "replace")}
    return v if isinstance(v, dict) else {"value": v}
