"""kiln entry point: `python train.py --job.config_file X --section.key value` or the same under torchrun."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from kiln_base.config import JobConfig
    from trainer.trainer import Trainer


def _setup_logging() -> None:
    # torchrun (run_train.sh) prefixes each line with the rank itself.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout
    )


def check_config(argv: list[str], world_size: int | None = None) -> JobConfig | None:
    """Validate the config and the files it names first (no torch, instant): run_train.sh calls it before
    torchrun, so a mistake is one line before any rank starts. With the world size (the launcher knows NGPU) the
    parallel degrees and the global batch are checked too. Returns the config, or None after printing the mistake."""
    from kiln_base.config import check_world, parse_args
    from kiln_base.errors import UserError, say

    log = logging.getLogger("kiln")
    level = log.level
    log.setLevel(logging.ERROR)  # the ranks parse the config again and log its notes and warnings once themselves
    try:
        cfg = parse_args(argv)
        if not cfg.job.dry_run:  # the dry run simulates its own world and plans for files that may be elsewhere
            if world_size is not None:
                check_world(cfg, world_size)
                check_pipeline_split(cfg)
            if not cfg.job.print_config:
                check_inputs(cfg)
    except UserError as e:
        say(e.line())
        return None
    finally:
        log.setLevel(level)
    return cfg


def check_pipeline_split(cfg: JobConfig) -> None:
    """With pipeline parallelism on, the split of the flavor's blocks (with model.n_layers) into stages, before any
    rank starts. It reads the flavor table in models/, whose package imports torch: a few seconds, paid only with
    pipelining on. A shape stored with checkpoint.initial_load_path (from_checkpoint) is checked by the ranks."""
    from kiln_base.config import FROM_CHECKPOINT, SHAPE_OVERRIDES, check_pipeline

    if cfg.parallelism.pipeline_parallel_degree == 1 or cfg.model.flavor == FROM_CHECKPOINT:
        return
    import dataclasses

    from models import LLAMA3_FLAVORS

    overrides = {key: getattr(cfg.model, key) for key in SHAPE_OVERRIDES if getattr(cfg.model, key) is not None}
    check_pipeline(cfg, dataclasses.replace(LLAMA3_FLAVORS[cfg.model.flavor], **overrides).shape())


def check_inputs(cfg: JobConfig) -> None:
    """The files a run reads first, without torch (instant): the tokenizer parses, the dataset is registered and
    its local files start with a good record. Before torchrun (launch.py) and before a rank imports torch; the
    Trainer meets the same errors through the same functions when built directly."""
    from trainer.components.data_sources import check_data_source
    from trainer.components.tokenizer import load_tokenizer

    load_tokenizer(cfg.model.tokenizer_path)
    check_data_source(cfg.training)


def exit_now(status: int) -> NoReturn:
    """End the process with `status` once kiln is done: flush the logs and streams, then skip the interpreter's
    teardown of torch's modules (0.5-1 s per process; ~2.5 s of a 4-rank run on 2 CPU cores). Whatever kiln
    writes is finished by then: Trainer.close waited for checkpoint saves, closed TensorBoard and the process
    group. Only for a normal return: an uncaught exception still exits through the interpreter (traceback)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(status)


def _log_paths(cfg: JobConfig) -> None:
    """Each path the run reads or writes, absolute, once at start-up (relative ones were taken from the cwd)."""
    log = logging.getLogger("kiln")
    log.info(f"Config file: {cfg.job.config_file or '(none: defaults and command line)'}")
    log.info(f"Dump folder: {cfg.job.dump_folder}")
    log.info(f"Tokenizer: {cfg.model.tokenizer_path}")
    if cfg.training.dataset_path is not None:
        log.info(f"Dataset: {cfg.training.dataset_path}")
    else:
        from trainer.components.data_sources import DATASETS

        spec = DATASETS.get(cfg.training.dataset)
        where = f" ({spec.path}{' on the Hugging Face hub' if spec.hub else ''})" if spec else ""
        log.info(f"Dataset: {cfg.training.dataset}{where}")
    if cfg.checkpoint.enable_checkpoint:
        log.info(f"Checkpoint folder: {os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)}")


def main(argv: list[str] | None = None) -> int:
    """Run kiln; the exit status as kiln_base/errors.py says (0 done, 1 non-finite, 2 a user mistake, 75 lost
    ranks, 130 Ctrl-C, 143 stopped by SIGTERM after saving)."""
    from kiln_base.errors import INTERRUPTED, say

    started: list = []  # the Trainer once built, so that a Ctrl-C can name the step it interrupted
    try:
        return _run(argv, started)
    except KeyboardInterrupt:  # stop now, one line, no traceback; a second Ctrl-C during the exit is ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        where = f" at step {started[0].step}" if started else ""
        say(f"kiln: interrupted by SIGINT (Ctrl-C){where}; nothing saved since the last checkpoint")
        return INTERRUPTED


def _run(argv: list[str] | None, started: list) -> int:
    from kiln_base.config import parse_args, to_toml
    from kiln_base.errors import DONE, KilnExit, PeersLost, UserError, report

    _setup_logging()
    try:
        cfg = parse_args(argv)
        if cfg.job.print_config:
            print(to_toml(cfg))
            return DONE
        if cfg.job.dry_run:
            from trainer.tools.dry_run import dry_run

            print(dry_run(cfg))
            return DONE
        check_inputs(cfg)
        from trainer.trainer import Trainer  # heavy imports only once the config is known to be good

        _log_paths(cfg)
        trainer = Trainer(cfg)
    except UserError as e:
        return report(e)
    started.append(trainer)
    try:
        trainer.train()
    except KilnExit as e:  # a user mistake met mid-run, a non-finite loss, a SIGTERM stop
        return report(e)
    except RuntimeError as e:  # a failed collective among them (gloo raises RuntimeError, NCCL DistBackendError)
        line = _lost_peers(trainer, e)
        if line is None:  # no rank is gone: not a lost peer, the traceback is the report
            raise
        return report(PeersLost(line))
    finally:
        trainer.close()
    return DONE


def _lost_peers(trainer: Trainer, e: Exception) -> str | None:
    """One line when `e` came with the loss of other ranks (they stopped beating, trainer/components/dist.py):
    which ranks and nodes, in which step, the backend's first line; None when every rank is alive."""
    if trainer.peers is None:
        return None
    lost = trainer.peers.lost_ranks()  # waits a few seconds: long enough to tell a gone rank from a busy one
    if lost == []:
        return None
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    reason = re.sub(r"^\[[^\]]*\] ", "", reason)  # gloo's "[.../pair.cc:537] " source position
    reason = reason if len(reason) <= 160 else reason[:157] + "..."
    rank = int(os.environ.get("RANK", 0))
    return (
        f"rank {rank} stopped in step {trainer.step}: "
        f"{trainer.peers.describe(lost)}; a collective failed ({reason}); torchrun restarts the job "
        "(MAX_RESTARTS) from the newest complete checkpoint"
    )


if __name__ == "__main__":
    exit_now(main())
