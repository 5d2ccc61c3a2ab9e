"""Runs train.py's main (plain `python` or under torchrun) and records rank 0's exact losses for tests.

    python tests/helpers/loss_driver.py OUT.json [train.py args ...]

Exit status and stderr are train.py's own (2 for user errors, 143 after SIGTERM, 130 on Ctrl-C). When the
Trainer closes, rank 0 writes {"first_step": N, "losses": [...]} to OUT.json: the Python floats of the steps
this process trained (N = the first of them), so runs compare bitwise. The product code has no test hook.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    close = Trainer.close

    def close_and_record(self: Trainer) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            with open(out, "w") as f:
                json.dump({"first_step": self.step - len(self.losses) + 1, "losses": self.losses}, f)
        close(self)

    Trainer.close = close_and_record
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
