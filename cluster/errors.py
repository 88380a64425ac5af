"""Errors of the local launcher; each message names the child and its log."""

from __future__ import annotations

import sys


class ClusterError(RuntimeError):
    """A child failed to start or become ready; the message names it and its log."""


class PortTakenError(ClusterError):
    """A child could not bind a port the launcher chose for it: another process on the
    machine bound it between the choice and the child's bind (seconds later, once the
    child has started)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class CrashLoopError(ClusterError):
    """A child kept exiting after restarts (more than the policy allows in its window);
    the launcher gives up and stops the whole cluster."""

    def __init__(self, name: str, log_path: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.log_path = log_path


def fail(message: str) -> int:
    """A user's mistake (a model directory we cannot run, flags that cannot go together,
    a file that is not there): one line on stderr and exit 2, as argparse does for a
    flag it does not know."""
    print(f"splitserve: error: {message}", file=sys.stderr)
    return 2
