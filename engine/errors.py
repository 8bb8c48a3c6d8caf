"""Exceptions the engine raises for requests it will not run.

The server maps each to a gRPC status; the engine itself knows nothing of gRPC.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's request errors."""


class InvalidRequestError(EngineError):
    """Invalid request parameters: ``violations`` lists (field, problem) pairs."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        self.violations = violations
        super().__init__("; ".join(f"{f}: {p}" for f, p in violations))


class ConstraintFailedError(InvalidRequestError):
    """The grammar engine failed partway through a choice's output (one of its limits hit): the request
    ends with this error after the tokens already reported; ``violations`` names the constraint."""


class ContextLengthError(EngineError):
    """The prompt (plus max_tokens under the reject policy) does not fit the context window."""

    def __init__(self, requested: int, limit: int, message: str) -> None:
        self.requested = requested
        self.limit = limit
        super().__init__(message)


class QueueFullError(EngineError):
    """The waiting queue is at its configured maximum; retry after ``retry_after_s``."""

    def __init__(self, queue_len: int, retry_after_s: float = 1.0) -> None:
        self.queue_len = queue_len
        self.retry_after_s = retry_after_s
        super().__init__(f"the waiting queue is full ({queue_len} requests); retry later")


class EngineStoppedError(EngineError):
    """The engine is shutting down and takes no new requests."""


class ModelUnloadedError(EngineStoppedError):
    """The model was unloaded (an admin's UnloadModel) before the request finished, or as it arrived."""

    def __init__(self, model: str) -> None:
        self.model = model
        super().__init__(f"model {model!r} was unloaded before the request finished")

    def __reduce__(self) -> tuple[type[ModelUnloadedError], tuple[str]]:
        return type(self), (self.model,)  # copies (one per request) rebuild from the model's name


class AdapterCapacityError(EngineError):
    """Every LoRA slot holds an adapter that requests are using: retry once one finishes.

    Not a QueueFullError: the queue may have room; what is short is adapter memory.
    """

    def __init__(self, name: str, max_loras: int, retry_after_s: float = 1.0) -> None:
        self.name = name
        self.max_loras = max_loras
        self.retry_after_s = retry_after_s
        super().__init__(f"adapter {name!r} needs a slot, and all {max_loras} (max_loras) hold adapters "
                         f"that requests are using; retry later")


class AdapterReloadNeededError(EngineError):
    """An evicted adapter's files changed or vanished since it was loaded, so it cannot be read back.

    The message names no server path (requesters are not admins); the stack logs the cause.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"adapter {name!r} must be reloaded: its files on the server changed or can no "
                         f"longer be read since it was loaded; an admin must unload and load it again")
