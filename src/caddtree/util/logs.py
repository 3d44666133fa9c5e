"""How the ``caddtree`` commands talk to a person: the library's log as ``caddtree: message`` lines
on stderr, and how a command ends (:func:`run_command`).

The library logs through :mod:`logging` under the ``caddtree`` logger (model conversion, profiling,
cached cost models) and never configures logging itself; the command line and ``caddtree serve``
call :func:`install_log_handler` (through :func:`run_command`) so that a person sees those
messages.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable

from .errors import CaddtreeError

__all__ = ["StderrLines", "install_log_handler", "run_command"]


class StderrLines(logging.Handler):
    """The command line's view of the library's log: ``caddtree: message`` on stderr, written to
    whatever ``sys.stderr`` is when the record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = "caddtree: warning: " if record.levelno >= logging.WARNING else "caddtree: "
            sys.stderr.write(prefix + self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never end the program
            self.handleError(record)


def install_log_handler() -> None:
    """Show the library's info messages and warnings (once, however often ``main`` runs)."""
    root = logging.getLogger("caddtree")
    if not any(isinstance(h, StderrLines) for h in root.handlers):
        root.addHandler(StderrLines())
    root.setLevel(logging.INFO)


def _quiet_broken_pipe() -> int:
    """Exit quietly after the reader of our output went away (``caddtree ... | head``), as Unix
    tools do: point stdout and stderr at /dev/null, so that the interpreter's final flush does not
    raise again, and return the status of a process ended by SIGPIPE (see the Python
    documentation's note on SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        # not every stream is a real file (e.g. under a test)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
    return 128 + getattr(signal, "SIGPIPE", 13)


def run_command(command: Callable[[], int]) -> int:
    """Run ``command`` (which returns the exit status) as every ``caddtree`` command runs: with
    the library's log shown (:func:`install_log_handler`), and ending without a traceback: a
    :class:`~caddtree.util.errors.CaddtreeError` is a ``caddtree: error: ...`` line and status 2,
    Ctrl-C is ``caddtree: interrupted`` and 130, a closed pipe (``caddtree ... | head``) ends
    quietly with the status of a process ended by SIGPIPE."""
    install_log_handler()
    _INTERRUPTS.clear()
    previous = _note_interrupts()
    try:
        status = command()
        sys.stdout.flush()  # a closed pipe is reported here, not at interpreter exit
        if _INTERRUPTS:
            # a Ctrl-C that some library swallowed (one that catches everything around an
            # import, under load): the user still asked to stop
            raise KeyboardInterrupt
        return status
    except CaddtreeError as exc:
        print(f"caddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("caddtree: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


# the Ctrl-Cs of the running command that nothing has handled (see run_command)
_INTERRUPTS: list[int] = []


@contextlib.contextmanager
def stop_on_interrupt():
    """Run the block until Ctrl-C, as a command that ends normally on it does (a server): the
    :class:`KeyboardInterrupt` ends the block, and :func:`run_command` does not report it."""
    try:
        yield
    except KeyboardInterrupt:
        _INTERRUPTS.clear()


def _note_interrupts():
    """Where Ctrl-C raises :class:`KeyboardInterrupt` as usual (Python's own handler, in the main
    thread), also note each one in ``_INTERRUPTS``; returns the handler to restore, or None where
    nothing was changed (Ctrl-C ignored, as for a shell's background job, or handled by the
    embedding program)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None

    def interrupt(signum, frame):
        _INTERRUPTS.append(signum)
        raise KeyboardInterrupt

    return signal.signal(signal.SIGINT, interrupt)
