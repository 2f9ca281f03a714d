"""How a request that fails inside the engine is answered and logged: the engine's errors as HTTP
errors, and a 500 that names the request, whose id the log line carries too.

Called by :mod:`megafleet_engine.openai.serving` around each request (:func:`failures`) and for a
stream that fails after it started (:func:`failed`). Only the failing request ends: the engine and
every other request go on (``docs/incidents.md#number-beyond-64-bits-hang``).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator

from megafleet_engine import engine as engine_module
from megafleet_engine.openai import errors, protocol

__all__ = ["engine_error", "failed", "failures", "new_request_id"]

log = logging.getLogger(__name__)


def new_request_id(prefix: str) -> str:
    """A response's ``id`` (``cmpl-...``, ``chatcmpl-...``); its sequences' ids in the engine and every
    log line about it start with it."""
    return f"{prefix}-{uuid.uuid4().hex}"


@contextlib.contextmanager
def failures(request_id: str) -> Iterator[None]:
    """Serve request ``request_id`` inside this: an internal error (500) raised in it, or anything
    unexpected, is logged with the request's id (and a traceback when unexpected) and answered as a
    500 whose message names the id; other HTTP errors pass as they are. Only this request fails:
    the engine and every other request go on."""
    try:
        yield
    except errors.HTTPError as error:
        if error.status != errors.InternalError.status:
            raise
        raise failed(request_id, error) from error
    except Exception as error:
        raise failed(request_id, error) from error


def failed(request_id: str, error: BaseException) -> errors.InternalError:
    """The 500 for request ``request_id`` that failed with ``error``, logged once with the id."""
    if isinstance(error, errors.HTTPError):
        log.error("request %s failed: %s", request_id, protocol.printable(error.message, limit=None))
        return errors.InternalError(f"{error.message} (request {request_id})")
    log.error("request %s failed", request_id, exc_info=error)
    return errors.InternalError(
        f"internal error ({type(error).__name__}) serving request {request_id}; the engine's log has the details"
    )


def engine_error(error: engine_module.EngineError) -> errors.HTTPError:
    """The HTTP error for an engine error."""
    if isinstance(error, engine_module.NotServing):
        return errors.ServiceUnavailable(f"the engine is {error.state} and does not accept requests", code=error.state)
    if isinstance(error, engine_module.Aborted):
        return errors.ServiceUnavailable(f"the request was aborted ({error}); retry it", code="aborted")
    return errors.InternalError(str(error))
