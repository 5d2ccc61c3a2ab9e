"""Runs kiln's Trainer for the checkpoint tests (plain `python` or under `torchrun`) with test hooks.

    python tests/helpers/ckpt_driver.py LOSSES.json [train.py args ...]

Rank 0 writes the exact losses of the steps it ran (Python floats, so bitwise comparable) to LOSSES.json.
Hooks, by environment variable (the product code has none):
  KILN_TEST_KILL_AFTER_SAVE=N  rank 0 SIGKILLs itself right after step N's checkpoint is published
  KILN_TEST_KILL_IN_SAVE=N     rank 0 SIGKILLs itself inside step N's save: every rank's files and the
                               marker are written, but the folder is not yet renamed to step-N
  KILN_TEST_KILL_IN_ASYNC_WRITE=N  rank 0 SIGKILLs itself in the background thread writing step N's files
                               (checkpoint.async_mode): its data file written, no .metadata yet, training going on
  KILN_TEST_KILL_IN_UPLOAD=N   rank 0 SIGKILLs itself in the background thread uploading step N to object storage
                               (checkpoint.async_mode, a URL folder): its data object uploaded, no .metadata or
                               kiln.json yet, training going on
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from kiln_base.config import parse_args  # noqa: E402
from trainer.checkpoint.checksums import ChecksummingWriter  # noqa: E402
from trainer.checkpoint.manager import CheckpointManager  # noqa: E402
from trainer.checkpoint.objects import ObjectStore  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def _install_hooks() -> None:
    kill_after = int(os.environ.get("KILN_TEST_KILL_AFTER_SAVE", "-1"))
    kill_in = int(os.environ.get("KILN_TEST_KILL_IN_SAVE", "-1"))
    kill_in_write = int(os.environ.get("KILN_TEST_KILL_IN_ASYNC_WRITE", "-1"))
    maybe_save, publish = CheckpointManager.maybe_save, CheckpointManager._publish
    write_data = ChecksummingWriter.write_data

    def maybe_save_then_die(self: CheckpointManager, step: int, last: bool = False) -> None:
        maybe_save(self, step, last)
        if step == kill_after and self.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def die_before_rename(self: CheckpointManager, step: int, weights_only: bool) -> None:
        if step == kill_in:
            marker = os.path.join(self.folder, f"step-{step}.tmp", "kiln.json")
            with open(marker, "w") as f:
                f.write("{}")
            os.kill(os.getpid(), signal.SIGKILL)
        publish(self, step, weights_only)

    def write_then_die(self: ChecksummingWriter, plan: Any, planner: Any) -> Any:
        done = write_data(self, plan, planner)
        in_background = threading.current_thread() is not threading.main_thread()
        if os.path.basename(os.fspath(self.path)) == f"step-{kill_in_write}.tmp" and in_background:
            if int(os.environ.get("RANK", "0")) == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        return done

    kill_in_upload = int(os.environ.get("KILN_TEST_KILL_IN_UPLOAD", "-1"))
    upload = ObjectStore.upload

    def upload_then_die(self: ObjectStore, local: str, name: str) -> None:
        upload(self, local, name)
        in_background = threading.current_thread() is not threading.main_thread()
        if name == f"step-{kill_in_upload}/__0_0.distcp" and in_background:
            os.kill(os.getpid(), signal.SIGKILL)

    ObjectStore.upload = upload_then_die  # type: ignore[method-assign]
    CheckpointManager.maybe_save = maybe_save_then_die
    ChecksummingWriter.write_data = write_then_die  # type: ignore[method-assign]
    CheckpointManager._publish = die_before_rename


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
    out, argv = sys.argv[1], sys.argv[2:]
    _install_hooks()
    trainer = Trainer(parse_args(argv))
    try:
        trainer.train()
    finally:
        trainer.close()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(trainer.losses, f)


if __name__ == "__main__":
    main()
