"""How a kiln run ends: the exit-status contract, the errors that carry a status, and the one-line report.

Every process kiln starts (run_train.sh's launcher, each rank, `python train.py`) ends with one of these statuses,
and every status but 0 with one line on stderr:

    0    done (or --job.print_config, --job.dry_run, the saved-activation report)
    1    a non-finite loss or gradient norm (NonFiniteError); no checkpoint is written after the bad step
    2    a user mistake (UserError: config, checkpoint, data): `kiln: error: <what and where>`
    75   a rank found other ranks gone (a failed collective): torchrun may restart the job (EX_TEMPFAIL)
    130  interrupted by Ctrl-C (SIGINT); nothing saved since the last checkpoint
    143  stopped by SIGTERM (preemption) after saving a full checkpoint (TrainingStopped)

The entry point (train.py) maps an exception to its status with `exit_status`; the launcher (launch.py) reuses
the same constants for what torchrun reports. Standard library only: the bottom of the import layers, so any
package may raise these. Programming errors stay ordinary exceptions (or asserts) and keep their tracebacks.
"""

from __future__ import annotations

import os
import signal
import sys

DONE = 0
NON_FINITE = 1
USER_ERROR = 2
PEER_LOST = 75  # EX_TEMPFAIL: "try again"; torchrun restarts the job while MAX_RESTARTS allows
INTERRUPTED = 128 + int(signal.SIGINT)  # 130, the shell's status for a process ended by Ctrl-C
PREEMPTED = 128 + int(signal.SIGTERM)  # 143, the shell's status for a process ended by SIGTERM


class KilnExit(Exception):
    """An expected way for a run to end early: a status and a line (`line`), no traceback."""

    status = 1
    prefix = "kiln: error: "

    def line(self) -> str:
        """The one line the user sees: the message with its own newlines folded."""
        return self.prefix + " ".join(str(self).splitlines())


class UserError(KilnExit):
    """Base of every user-fixable error: `kiln: error: <message>`, exit 2."""

    status = USER_ERROR


class ConfigError(UserError, ValueError):
    """A configuration mistake: unknown key, wrong type or range, invalid combination, missing file."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used: incomplete, from another layout or shape, or unsafe to load."""


class DataError(UserError):
    """A dataset problem: unreadable file, malformed or empty record (the message names file and record)."""


class NonFiniteError(KilnExit, RuntimeError):
    """Training produced a NaN or inf loss or gradient norm; the run stops before any later save (exit 1)."""

    status = NON_FINITE


class TrainingStopped(KilnExit):
    """Training stopped early on request (SIGTERM) after saving; `kiln: <message>`, exit 143."""

    status = PREEMPTED
    prefix = "kiln: "


class PeersLost(KilnExit):
    """A collective failed because other ranks are gone (the message names them); exit 75. `lost` says which
    ("lost rank 3 (host h)"), for the launcher's last line."""

    status = PEER_LOST

    def __init__(self, line: str, lost: str = "") -> None:
        super().__init__(line)
        self.lost = lost


def say(line: str) -> None:
    """One line on stderr in a single write, so the lines of ranks sharing the stream never interleave."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (captured in tests)
        print(line, file=sys.stderr)
        return
    os.write(fd, (line + "\n").encode())


# Under run_train.sh a rank appends its user error or non-finite stop here as "<status> <line>", and the launcher
# prints the first line once for all ranks and exits with its status: printed by the rank, it would reach the user
# inside torchrun's multi-line failure report.
ERROR_FILE_ENV = "KILN_ERROR_FILE"
# ... and a rank that found others gone appends what it lost here: the launcher's last line names them even when
# torchrun stopped the ranks it shows (LOG_RANK) before they printed.
LOST_FILE_ENV = "KILN_LOST_FILE"


def report(e: KilnExit) -> int:
    """Print `e`'s line and return its exit status. A user error or a non-finite stop under run_train.sh goes to
    the launcher's error file instead (one write), which the launcher prints in place of torchrun's report."""
    path = os.environ.get(ERROR_FILE_ENV)
    if isinstance(e, (UserError, NonFiniteError)) and path:
        with open(path, "a") as f:
            f.write(f"{e.status} {e.line()}\n")
    else:
        say(e.line())
    lost_file = os.environ.get(LOST_FILE_ENV)
    if isinstance(e, PeersLost) and e.lost and lost_file:
        with open(lost_file, "a") as f:
            f.write(e.lost + "\n")
    return e.status
