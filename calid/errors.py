"""Exceptions with messages meant for the person at the terminal or API.

The CLI prints ``str(exc)`` of a :class:`CalidError` as one line and exits 2;
anything else is a bug and shows a traceback.
"""


class CalidError(Exception):
    """Base class: a clear, user-facing error."""


class ModelSourceError(CalidError):
    """A model could not be found, fetched, verified or converted."""


class InvalidRequestError(CalidError, ValueError):
    """A generation request has a bad field; the message names the field."""


class UncalibratedError(InvalidRequestError):
    """A request asks for something the served pair has no calibration for (gRPC FAILED_PRECONDITION)."""
