"""fleet_client: submit tasks to a fleet over AMQP (publisher confirms) and follow them over
the scheduler's HTTP API. See clients/python/README.md."""

from .client import (
    FAILED_STATES,
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
]
__version__ = "0.1.0"
