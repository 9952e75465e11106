"""The one failure of reading a job's media."""

from __future__ import annotations


class MediaError(ValueError):
    """Media refused: ``code`` is the protocol's (``limit_exceeded``, ``invalid_field``), the
    message names the item and why. A ValueError, as the engine's other input errors."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def missing_extra(exc: ImportError) -> MediaError:
    """A worker without the vision extra, asked to read media."""
    return MediaError(
        "invalid_field",
        f"this worker cannot read images or videos ({exc.name} is not installed): its "
        # A fixed form, not the host's checkout path: the producer reads this line.
        "operator installs the vision extra, pip install '.[vision]' in the worker's checkout",
    )
