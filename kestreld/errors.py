"""Every kind of failure, one exception type each, and its wire code (the one mapping).

Raise these anywhere in the daemon; the server turns them into
`{"code": ..., "message": ...}` with `to_wire`. Anything else that escapes becomes
`internal`. Messages state the limit and the value received.
"""
from __future__ import annotations


class KestrelError(Exception):
    """Base: a failure with a protocol error code."""
    code = "internal"

    def to_wire(self) -> dict:
        return {"code": self.code, "message": str(self)}


class BadRequest(KestrelError):
    code = "bad_request"


class UnknownMethod(KestrelError):
    code = "unknown_method"


class TooLarge(KestrelError):
    code = "too_large"


class PromptTooLong(KestrelError):
    code = "prompt_too_long"


class QueueFull(KestrelError):
    code = "queue_full"


class Cancelled(KestrelError):
    code = "cancelled"


class ShuttingDown(KestrelError):
    code = "shutting_down"


class PermissionDenied(KestrelError):
    code = "permission_denied"


class InternalError(KestrelError):
    code = "internal"


class ModelLoadError(Exception):
    """A model file or directory cannot be used; the message names the file and the fault.

    Not a wire error: it stops start-up with one line (see main)."""


class KernelsMissing(Exception):
    """The compiled kernels do not import; Kestrel refuses to run without them."""


WIRE_CODES = ("bad_request", "unknown_method", "too_large", "prompt_too_long", "queue_full",
              "cancelled", "shutting_down", "permission_denied", "internal")


def to_wire(exc: BaseException) -> dict:
    """The protocol error map for any exception (unknown ones are `internal`)."""
    if isinstance(exc, KestrelError):
        return exc.to_wire()
    return {"code": "internal", "message": f"internal error: {type(exc).__name__}: {exc}"}


class StartupError(Exception):
    """The daemon cannot start (e.g. the socket path is in use or is not a socket); one
    line on stderr, exit 1 (see main)."""
