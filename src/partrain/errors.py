"""One error type for everything the user can fix.

A ``PartrainError`` is bad input or a configuration that cannot run: the CLI prints its
message as one line (``partrain: error: ...``) and exits with status 2, with no
traceback (1 for ``PeerLeft``: a worker stopped by another's failure, not by bad input).
Anything else that escapes is a bug in partrain and keeps its traceback. With
``partrain --debug`` the traceback behind a one-line error is printed too, by the launcher
and by every worker it starts (they read ``DEBUG_ENV``).
"""

from collections.abc import Iterator

DEBUG_ENV = "PARTRAIN_DEBUG"


def causes(err: BaseException | None) -> Iterator[BaseException]:
    """``err``, then the error it was raised from, and so on (a runtime's wrapper, such as the
    pipelining stage's "failed to run forward", before the error behind it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__


class PartrainError(Exception):
    """A problem the user can fix; ``str(err)`` names the problem and the fix."""

    exit_status = 2


class PeerLeft(PartrainError):
    """This worker stopped because another worker left the job (under torchrun, mpirun or
    Slurm): the cause, and the line that names it, are that worker's. One line here, not the
    backend's traceback, and exit status 1: it is no bad input of this worker's."""

    exit_status = 1


class WaitedTooLong(PartrainError):
    """A worker gave up waiting for another (``--timeout``): the other is slow or stuck, and
    which one this worker cannot tell. One line, exit status 1: no bad input of the user's."""

    exit_status = 1


class Diverged(PartrainError):
    """The loss stopped being a number: the weights are NaN or infinite, and every further step
    would be wasted. One line naming the step and the fix (a smaller --lr, most often), exit
    status 1: the input was valid, the run failed."""

    exit_status = 1
