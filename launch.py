"""The launcher behind run_train.sh: check the config for this node's world size, then torchrun train.py.

    CONFIG_FILE  TOML config (default: kiln's train_configs/debug_model.toml); --job.config_file in the arguments wins
    NGPU         processes on this node (default: the visible GPUs, else one CPU rank)
    LOG_RANK     ranks whose output is shown (default: 0)

Every user mistake ends with exit status 2 and one line `kiln: error: ...` on stderr:

- what the config and NGPU decide is checked here before any rank starts (standard library, instant);
- what only a rank can find (a tokenizer file's contents, a checkpoint of another model, a bad record) the rank
  appends as one line to KILN_ERROR_FILE before it exits 2 (train.report_user_error); torchrun then fails, and
  this launcher prints that line in place of torchrun's report (a log line per failed rank and a ChildFailedError
  traceback). Any other failure keeps torchrun's output and exit status.

torchrun runs in this process (torch.distributed.run is the code behind the `torchrun` command) and run_train.sh
execs this script, so signals (SIGTERM on preemption, Ctrl-C) reach torchrun as they did with `exec torchrun`,
and the ranks' output streams live as before.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, TextIO

KILN_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(KILN_DIR, "train_configs", "debug_model.toml")


class QuietAfterUserError:
    """Wraps sys.stderr: passes everything through until a rank has written a user error to `error_file`, then
    drops what follows (torchrun's report of the failure would bury the one line that matters).

    A rank writes the file before it exits, and torchrun reports only after a rank has exited, so the report
    always comes after the file is non-empty; output written before the error passes live.
    """

    def __init__(self, stream: TextIO, error_file: str) -> None:
        self._stream, self._error_file = stream, error_file

    def _quiet(self) -> bool:
        try:
            return os.path.getsize(self._error_file) > 0
        except OSError:
            return False

    def write(self, text: str) -> int:
        return len(text) if self._quiet() else self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def _nproc(value: str | None) -> int:
    if value is None or value == "":
        import torch  # only to count GPUs; torchrun imports it anyway

        return torch.cuda.device_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"NGPU must be a positive integer (processes on this node), got '{value}'")
    return int(value)


def _log_ranks(value: str, nproc: int) -> str:
    ranks = value.split(",")
    if not all(r.isdigit() and int(r) < nproc for r in ranks):
        raise ValueError(f"LOG_RANK must be a comma-separated list of ranks in 0..{nproc - 1}, got '{value}'")
    return value


def main(argv: list[str]) -> int:
    fd, error_file = tempfile.mkstemp(prefix="kiln_error_", suffix=".txt")
    os.close(fd)
    real_stderr = sys.stderr
    # Before torch is imported: its log handler and torchrun's rank-output tee capture sys.stderr as it is then.
    sys.stderr = QuietAfterUserError(real_stderr, error_file)
    try:
        return _launch(argv, error_file, real_stderr)
    finally:
        sys.stderr = real_stderr
        os.unlink(error_file)


def _launch(argv: list[str], error_file: str, real_stderr: TextIO) -> int:
    import train

    try:
        nproc = _nproc(os.environ.get("NGPU"))
        log_rank = _log_ranks(os.environ.get("LOG_RANK") or "0", nproc)
    except ValueError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    # CONFIG_FILE first: parse_args takes the last --job.config_file, so one in argv wins.
    args = ["--job.config_file", os.environ.get("CONFIG_FILE") or DEFAULT_CONFIG, *argv]
    status = train.check_config(args, world_size=nproc)
    if status:
        return status

    os.environ["LOG_RANK"] = log_rank  # the Trainer logs metrics on these ranks
    os.environ["KILN_ERROR_FILE"] = error_file
    if nproc > 1:
        # torchrun's own default with several ranks per node, set here to spare its 4-line banner on every launch.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # OpenMP threads that spin while they wait for each other are ruinous on shared cores: a thread spins while the
    # one it waits for is descheduled. The debug run on a 2-core machine shared with other jobs took 4.5-7.7 min
    # with libgomp's default and 1.2-1.5 min with passive waiting (docs/performance.md). Yours to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import parse_args, run

    torchrun_args = [
        *("--nproc_per_node", str(nproc), "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"),
        *("--local-ranks-filter", log_rank, "--role", "rank", "--tee", "3"),
        os.path.join(KILN_DIR, "train.py"),
        *args,
    ]
    try:
        record(run)(parse_args(torchrun_args))  # record: torchrun's own failure summary, as `torchrun` has it
    except ChildFailedError:
        with open(error_file) as f:
            first = f.readline().strip()
        if not first:
            raise  # not a user mistake: torchrun's report and exit status, unchanged
        print(first, file=real_stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
