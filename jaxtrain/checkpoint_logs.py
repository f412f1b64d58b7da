"""orbax's own reports of a failed save, dropped: the failure reaches Checkpointer.save/wait as
an exception and CheckpointSaveError reports it in one line, where orbax's threads printed 4-35
absl tracebacks (~330 lines) before it and TensorStore's write callbacks dozens more."""
from __future__ import annotations

import logging
import os
import sys
import traceback


class _OrbaxTracebacks(logging.Filter):
    """Drops ERROR records with a traceback through orbax: absl's from orbax's save threads,
    asyncio's "exception was never retrieved" of its write tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info or not record.exc_info[2]:
            return True
        frames = traceback.extract_tb(record.exc_info[2])
        return not any(f"{os.sep}orbax{os.sep}" in f.filename for f in frames)


def drop_orbax_save_tracebacks() -> None:
    """Install the filters below (once per process)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OrbaxTracebacks) for f in logger.filters):
            logger.addFilter(_OrbaxTracebacks())
    if not getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
        sys.unraisablehook = _without_closed_loop_callbacks(sys.unraisablehook)


def _without_closed_loop_callbacks(hook):
    """`hook` (sys.unraisablehook), silent for the "Event loop is closed" that TensorStore's
    write callbacks raise when a failed save's event loop closed before they completed."""
    def unraisablehook(args):
        last = traceback.extract_tb(args.exc_traceback)[-1:] if args.exc_traceback else []
        if (args.exc_type is RuntimeError and str(args.exc_value) == "Event loop is closed"
                and last and last[0].name == "_check_closed"):
            return
        hook(args)
    unraisablehook.drops_closed_loop_callbacks = True
    return unraisablehook
