"""fleet_client: submit tasks to a fleet over AMQP (publisher confirms) and follow them over
the scheduler's HTTP API. See clients/python/README.md."""

from .client import (
    BATCH_CLOSE_TYPE,
    FAILED_STATES,
    MAX_BATCH_TASKS,
    TERMINAL_STATES,
    ApiError,
    Client,
    FleetError,
    Refused,
    Task,
    TaskFailed,
    Unconfirmed,
    UnknownTask,
    WaitTimeout,
)

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
__version__ = "0.1.0"
