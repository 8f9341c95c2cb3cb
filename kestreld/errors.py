"""Every kind of failure, one exception type each, and the one table of what it maps to:
its wire code (the protocol's `error.code`), its HTTP status, and the exit status of the
command that met it (kestrelctl for a request's errors; kestreld for a fatal start-up).

Raise these anywhere in the daemon. A request's error travels back to its client as
`to_wire(exc)`; anything that is not a KestrelError becomes `internal` through `internal()`.
Messages state the limit and the value received. kestrelctl imports this module (it
imports nothing else of the daemon).
"""
from __future__ import annotations

from typing import Optional


class KestrelError(Exception):
    """Base: a request's failure. Each kind states, in its class line, its error code, its
    HTTP status and the exit status kestrelctl returns for it (None: kestrelctl never meets
    it); `wire` False: a code the RPC socket never sends (client side or HTTP API only);
    `http_code`: the code the HTTP API sends, OpenAI's where it has its own for the same
    failure (OpenAI clients look for it), else `code`."""
    code, http_status, exit_status, wire, http_code = "internal", 500, 10, True, "internal"

    def __init_subclass__(cls, code: str, http_status: int, exit_status: Optional[int],
                          wire: bool = True, http_code: Optional[str] = None, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.code, cls.http_status, cls.exit_status, cls.wire = code, http_status, exit_status, wire
        cls.http_code = http_code or code

    def __init__(self, message: str = "", param: Optional[str] = None):
        super().__init__(message)
        self.param = param    # the request field at fault, when known (OpenAI's error.param)

    def to_wire(self) -> dict:
        return {"code": self.code, "message": str(self)}


class BadRequest(KestrelError, code="bad_request", http_status=400, exit_status=2):
    """A malformed request: unknown or mistyped parameters, a value out of its range, an
    image that does not decode, a chat the model's template refuses."""


class UnknownMethod(KestrelError, code="unknown_method", http_status=404, exit_status=3):
    """A method name the protocol does not have."""


class TooLarge(KestrelError, code="too_large", http_status=413, exit_status=4):
    """A message over --max-message-bytes (or an HTTP body over the same limit)."""


class PromptTooLong(KestrelError, code="prompt_too_long", http_status=400, exit_status=5,
                    http_code="context_length_exceeded"):
    """A prompt that leaves the KV arena no room for one new token."""


class QueueFull(KestrelError, code="queue_full", http_status=429, exit_status=6):
    """More requests waiting than --max-queue allows."""


class ShuttingDown(KestrelError, code="shutting_down", http_status=503, exit_status=7):
    """The daemon stops: queued requests are answered with this, new ones refused."""


class Cancelled(KestrelError, code="cancelled", http_status=499, exit_status=8):
    """A request cancelled (by `cancel` or a disconnect) before it started; one that had
    started ends normally with finish_reason "cancelled" instead. (HTTP 499: the client
    closed the request, as nginx names it.)"""


class PermissionDenied(KestrelError, code="permission_denied", http_status=403, exit_status=9):
    """A path outside --image-dir, or a socket the client may not open."""


class NotEmbeddingModel(KestrelError, code="not_embedding_model", http_status=400,
                        exit_status=12):
    """Embeddings asked of a model whose file names no pooling (a chat model), and the
    daemon was not started with --pooling."""


class InternalError(KestrelError, code="internal", http_status=500, exit_status=10):
    """A bug: anything unexpected that escapes while serving a request."""


class Unavailable(KestrelError, code="unavailable", http_status=503, exit_status=11, wire=False):
    """Client side only: no daemon at the socket, or the connection broke."""


# HTTP API only (service/http.py): the RPC socket never sends these codes and kestrelctl
# never meets them.

class Unauthorized(KestrelError, code="unauthorized", http_status=401, exit_status=None, wire=False):
    """An API key is configured and the request did not carry it."""


class NotFound(KestrelError, code="not_found", http_status=404, exit_status=None, wire=False):
    """No such HTTP path (or model id)."""


class ModelNotFound(KestrelError, code="model_not_found", http_status=404, exit_status=None,
                    wire=False):
    """Under --strict-model: a request naming a model this daemon does not serve (OpenAI's
    code; without --strict-model the loaded model answers, as llama.cpp's server does)."""


class MethodNotAllowed(KestrelError, code="method_not_allowed", http_status=405,
                       exit_status=None, wire=False):
    """An HTTP method the path does not take."""


class UnsupportedMediaType(KestrelError, code="unsupported_media_type", http_status=415,
                           exit_status=None, wire=False):
    """A request body that is not declared `application/json` (a browser may send
    text/plain or a form to any site without asking first: CSRF)."""


class Loading(KestrelError, code="loading", http_status=503, exit_status=None, wire=False):
    """The HTTP listener is up but the model is still loading."""


REQUEST_ERRORS = tuple(KestrelError.__subclasses__())      # in the order above
WIRE_CODES = tuple(e.code for e in REQUEST_ERRORS if e.wire)
BY_CODE = {e.code: e for e in REQUEST_ERRORS}
EXIT_STATUS = {e.code: e.exit_status for e in REQUEST_ERRORS  # kestrelctl's exit statuses
               if e.exit_status is not None}
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


class InsufficientMemory(FatalError):
    """The model's weights and KV arena would not fit the memory available."""


class StartupError(FatalError):
    """The daemon cannot start (e.g. the socket path is in use or is not a socket)."""
