"""kiln entry point: `python train.py --job.config_file X --section.key value` or the same under torchrun."""

from __future__ import annotations

import logging
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
        from trainer.tools.guards import NonFiniteError
        from trainer.train import Trainer  # heavy imports only once the config is known to be good

        trainer = Trainer(cfg)
    except UserError as e:  # config, checkpoint or data mistakes: one line, exit 2
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    except UserError as e:  # met mid-run: a malformed record, a float8 flag that did nothing at step 1, a refused save
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
