"""Ctrl-C in a script's first seconds, while it imports torch (seconds, more on a shared file
system): a KeyboardInterrupt raised inside that import was a 30-line traceback of torch's
internals. A script run as a program ends at once there instead, as killed by SIGINT, until
its main() makes a Ctrl-C a KeyboardInterrupt again, which it turns into one line.

Standard library only: a script calls quiet_while_loading before it imports torch."""

from __future__ import annotations

import signal


def quiet_while_loading(module_name: str) -> None:
    """A script's first call (its ``__name__``): run as a program, a Ctrl-C now ends it. A
    SIGINT ignored, as a background job's, stays ignored; an imported script changes nothing."""
    if module_name == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def raises() -> None:
    """From here a Ctrl-C raises KeyboardInterrupt, which the caller turns into its one-line
    message. A handler of anyone else's is left alone."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)
