"""kiln entry point: `python train.py --job.config_file X --section.key value` or the same under torchrun."""

from __future__ import annotations

import logging
import signal
import sys


def _setup_logging() -> None:
    # torchrun (run_train.sh) prefixes each line with the rank itself.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout
    )


def check_config(argv: list[str]) -> int:
    """Validate the config only (standard library, instant): run_train.sh calls it before torchrun, whose
    launcher would otherwise turn a one-line config error into exit 1 and a traceback per rank."""
    from trainer.config import parse_args
    from trainer.errors import UserError

    try:
        parse_args(argv)
    except UserError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run kiln. Exit status: 0 done, 1 non-finite loss, 2 a user mistake (config, checkpoint, data), 143 stopped
    by SIGTERM after saving a checkpoint (trainer/components/preemption.py), 130 interrupted by Ctrl-C (SIGINT)."""
    started: list = []  # the Trainer once built, so that a Ctrl-C can name the step it interrupted
    try:
        return _run(argv, started)
    except KeyboardInterrupt:  # stop now, one line, no traceback; a second Ctrl-C during the exit is ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        where = f" at step {started[0].step}" if started else ""
        print(f"kiln: interrupted by SIGINT (Ctrl-C){where}; nothing saved since the last checkpoint", file=sys.stderr)
        return 130


def _run(argv: list[str] | None, started: list) -> int:
    from trainer.config import parse_args, to_toml
    from trainer.errors import UserError

    _setup_logging()
    try:
        cfg = parse_args(argv)
        if cfg.job.print_config:
            print(to_toml(cfg))
            return 0
        if cfg.job.dry_run:
            from trainer.tools.dry_run import dry_run

            print(dry_run(cfg))
            return 0
        from trainer.components.preemption import TrainingStopped
        from trainer.tools.guards import NonFiniteError
        from trainer.train import Trainer  # heavy imports only once the config is known to be good

        trainer = Trainer(cfg)
    except UserError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    started.append(trainer)
    try:
        trainer.train()
    except UserError as e:  # met mid-run: a malformed record, a float8 flag that did nothing at step 1, a refused save
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except TrainingStopped as e:
        print(f"kiln: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
