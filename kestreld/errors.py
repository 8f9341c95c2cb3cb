"""Every kind of failure, one exception type each, and the one table of what it maps to:
its wire code (the protocol's `error.code`), its HTTP status, and the exit status of the
command that met it (kestrelctl for a request's errors; kestreld for a fatal start-up).

Raise these anywhere in the daemon. A request's error travels back to its client as
`to_wire(exc)`; anything that is not a KestrelError becomes `internal` through `internal()`.
Messages state the limit and the value received. kestrelctl imports this module (it
imports nothing else of the daemon).
"""
from __future__ import annotations


class KestrelError(Exception):
    """Base: a request's failure, with its protocol error code, HTTP status and the exit
    status kestrelctl returns for it."""
    code = "internal"
    http_status = 500
    exit_status = 10
    wire = True               # a code the RPC socket sends (False: HTTP API or client only)

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param    # the request field at fault, when known (OpenAI's error.param)

    def to_wire(self) -> dict:
        return {"code": self.code, "message": str(self)}


class BadRequest(KestrelError):
    code, http_status, exit_status = "bad_request", 400, 2


class UnknownMethod(KestrelError):
    code, http_status, exit_status = "unknown_method", 404, 3


class TooLarge(KestrelError):
    code, http_status, exit_status = "too_large", 413, 4


class PromptTooLong(KestrelError):
    code, http_status, exit_status = "prompt_too_long", 400, 5


class QueueFull(KestrelError):
    code, http_status, exit_status = "queue_full", 429, 6


class ShuttingDown(KestrelError):
    code, http_status, exit_status = "shutting_down", 503, 7


class Cancelled(KestrelError):
    code, http_status, exit_status = "cancelled", 499, 8


class PermissionDenied(KestrelError):
    code, http_status, exit_status = "permission_denied", 403, 9


class InternalError(KestrelError):
    code, http_status, exit_status = "internal", 500, 10


class Unavailable(KestrelError):
    """Client side only: no daemon at the socket, or the connection broke."""
    code, http_status, exit_status, wire = "unavailable", 503, 11, False


# HTTP API only (service/http.py): the RPC socket never sends these codes and kestrelctl
# never meets them, so they have no exit status of their own.

class Unauthorized(KestrelError):
    """An API key is configured and the request did not carry it."""
    code, http_status, wire = "unauthorized", 401, False


class NotFound(KestrelError):
    """No such HTTP path (or model id)."""
    code, http_status, wire = "not_found", 404, False


class MethodNotAllowed(KestrelError):
    code, http_status, wire = "method_not_allowed", 405, False


class Loading(KestrelError):
    """The HTTP listener is up but the model is still loading."""
    code, http_status, wire = "loading", 503, False


REQUEST_ERRORS = (BadRequest, UnknownMethod, TooLarge, PromptTooLong, QueueFull, ShuttingDown,
                  Cancelled, PermissionDenied, InternalError, Unavailable)
HTTP_ERRORS = (Unauthorized, NotFound, MethodNotAllowed, Loading)
WIRE_CODES = tuple(e.code for e in REQUEST_ERRORS if e.wire)
BY_CODE = {e.code: e for e in REQUEST_ERRORS}
EXIT_STATUS = {e.code: e.exit_status for e in REQUEST_ERRORS}   # kestrelctl's exit statuses
EXIT_INTERRUPTED = 130        # a command stopped by Ctrl-C


def internal(exc: BaseException) -> KestrelError:
    """`exc` itself if it is a KestrelError, else an InternalError naming it (an engine or
    server bug must reach the client as `internal`, never kill the daemon)."""
    if isinstance(exc, KestrelError):
        return exc
    return InternalError(f"internal error: {type(exc).__name__}: {exc}")


def to_wire(exc: BaseException) -> dict:
    """The protocol error map of any exception (unknown ones are `internal`)."""
    return internal(exc).to_wire()


# ---------------------------------------------------------------- fatal: kestreld stops

class FatalError(Exception):
    """kestreld cannot start or go on: one line on stderr, exit status 1 (see main)."""
    exit_status = 1


class ModelLoadError(FatalError):
    """A model file or directory cannot be used; the message names the file and the fault."""


class KernelsMissing(FatalError):
    """The compiled kernels do not import; Kestrel refuses to run without them."""


class StartupError(FatalError):
    """The daemon cannot start (e.g. the socket path is in use or is not a socket)."""
