"""A child process that dies with its parent: Linux's PR_SET_PDEATHSIG, and the check that closes
its race (a parent that died before the request took effect). Used by the engine core (its API
process is the parent) and by every process `ember up` starts, so that a SIGKILLed parent leaves
nothing running; and what a process that died anyway left behind (`pid_alive`,
`left_by_dead_processes`). Imports nothing from ember."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Loaded here, in the parent: a forked child (`child_dies_with_us`) then calls prctl without
# loading anything between fork and exec.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies, whatever it is doing; exit
    at once if the parent is gone already. Linux only; elsewhere nothing is asked.

    The signal follows the parent *thread* that started us: the parent must start its children
    from a thread that lives as long as it does (its main thread, or its event loop's)."""
    if _LIBC is not None and _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent_pid:  # it died before the request above took effect
        os._exit(1)


def child_dies_with_us(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when this process dies (a
    SIGTERM lets an engine stop its own children in turn)."""
    parent = os.getpid()

    def preexec() -> None:
        die_with_parent(parent, sig)

    return preexec


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's too: signalling it is refused, not missing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def left_by_dead_processes(paths: Iterable[Path], prefix: str) -> list[Path]:
    """Those of `paths` named `<prefix><pid>-...` whose process is gone and that belong to this
    user: what a SIGKILLed process could not remove. A live process's, another user's, or one
    that vanished meanwhile, are left out."""
    dead = []
    for p in paths:
        pid = p.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            if p.stat().st_uid == os.getuid():
                dead.append(p)
        except OSError:
            continue
    return dead
