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


def check_config(argv: list[str], world_size: int | None = None, local_ranks: int = 1) -> JobConfig | None:
    """Validate the config, the files it names and the model it builds before any rank starts: run_train.sh calls
    it before torchrun, so a mistake is one line before any rank imports anything. With the world size (the
    launcher knows NGPU; `local_ranks` of them on this node) the parallel degrees, the global batch, the model's
    shape from every source (flavor + model.*, config.json, kiln.json), the TP plan, the pipeline split and, on a
    CPU node, the memory the ranks need are checked too. Returns the config, or None after printing the mistake."""
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
            if not cfg.job.print_config:
                words = check_inputs(cfg)
                if world_size is not None:
                    check_model(cfg, words, world_size, local_ranks)
    except UserError as e:
        say(e.line())
        return None
    finally:
        log.setLevel(level)
    return cfg


def check_inputs(cfg: JobConfig) -> int:
    """The files a run reads first, without torch (instant): the tokenizer parses, the dataset is registered and
    its local files start with a good record. Before torchrun (launch.py) and before a rank imports torch; the
    Trainer meets the same errors through the same functions when built directly. Returns the tokenizer's size."""
    from trainer.components.tokenizer import load_tokenizer
    from trainer.data.sources import check_data_source

    words = load_tokenizer(cfg.model.tokenizer_path).n_words
    check_data_source(cfg.training, words)
    if cfg.validation.enable:
        check_data_source(cfg.validation, words)
    return words


def check_model(cfg: JobConfig, tokenizer_words: int, world_size: int, local_ranks: int) -> None:
    """The launcher's copy of what each rank checks before it builds (trainer/build.py, the same functions): the
    shape from every source, the tensor-parallel plan and the pipeline split for it, and on a CPU node that the
    model (each pipeline rank's stages) fits the RAM the node's ranks share (on CUDA each rank checks its GPU: the
    launcher holds no CUDA context). The run's plan is the ranks' own (trainer/build.py run_plan)."""
    import torch

    from trainer import build
    from trainer.checkpoint.initial_load import open_source

    path = cfg.checkpoint.initial_load_path
    args = build.model_args(cfg.model, cfg.training.seq_len, tokenizer_words, open_source(path) if path else None)
    gpus = torch.cuda.device_count()
    plan = build.run_plan(cfg, args, world_size, "cuda" if gpus else "cpu")  # what each rank plans again
    if not gpus:
        build.check_fits(cfg, plan, local_ranks, torch.device("cpu"))


def print_dry_run(cfg: JobConfig, world_size: int | None = None) -> int:
    """--job.dry_run: print the plan for `world_size` ranks (None: the degrees' product), exit 0; or the line of
    the rule it breaks, which is the launcher's (the same run_plan), exit 2. The launcher and `python train.py`."""
    from kiln_base.errors import DONE, UserError, report
    from trainer.tools.dry_run import dry_run

    try:
        print(dry_run(cfg, world_size))
    except UserError as e:
        return report(e)
    return DONE


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
    from kiln_base.files import output_location

    log = logging.getLogger("kiln")
    log.info(f"Config file: {cfg.job.config_file or '(none: defaults and command line)'}")
    log.info(f"Dump folder: {cfg.job.dump_folder}")
    log.info(f"Tokenizer: {cfg.model.tokenizer_path}")
    log.info(f"Dataset: {_dataset_name(cfg.training.dataset, cfg.training.dataset_path)}")
    if cfg.validation.enable:
        log.info(f"Validation dataset: {_dataset_name(cfg.validation.dataset, cfg.validation.dataset_path)}")
        t, v = cfg.training, cfg.validation
        if _data_source(t.dataset, t.dataset_path) == _data_source(v.dataset, v.dataset_path):
            log.warning(
                "Validation reads the training data: its loss measures the fit to data it trains on, not to "
                "held-out data; point validation.dataset or validation.dataset_path at a held-out split"
            )
    if cfg.checkpoint.enable_checkpoint:
        log.info(f"Checkpoint folder: {output_location(cfg.job.dump_folder, cfg.checkpoint.folder)}")


def _data_source(name: str, path: str | None) -> str:
    """Where a dataset is read from: its local file or folder (real path), else its hub id, config and split."""
    from trainer.data.sources import DATASETS

    spec = DATASETS.get(name)
    if path is None and spec is not None and spec.hub:
        return f"{spec.path} {spec.hub_config} {spec.split}"
    return os.path.realpath(path or (spec.path if spec else name))


def _dataset_name(name: str, path: str | None) -> str:
    """A dataset as the start-up log names it: the local path, or the registered name and where it reads."""
    if path is not None:
        return path
    from trainer.data.sources import DATASETS

    spec = DATASETS.get(name)
    return f"{name} ({spec.path}{' on the Hugging Face hub' if spec.hub else ''})" if spec else name


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
            return print_dry_run(cfg)
        check_inputs(cfg)
        from trainer.trainer import Trainer  # heavy imports only once the config is known to be good

        _log_paths(cfg)
        trainer = Trainer(cfg)
    except UserError as e:
        return report(e)
    started.append(trainer)
    try:
        try:
            trainer.train()
        except RuntimeError as e:  # a failed collective among them (gloo raises RuntimeError, NCCL DistBackendError)
            lost = _lost_peers(trainer, e)
            if lost is None:  # no rank is gone: not a lost peer, the traceback is the report
                raise
            raise PeersLost(*lost) from None
        except TimeoutError:  # torchft's quorum: no answer within comm.init_timeout_seconds
            if not trainer.cfg.fault_tolerance.enable:
                raise
            raise PeersLost(*_no_quorum(trainer)) from None
        finally:
            trainer.close()  # a background save that fails here (a full disk) is a KilnExit too
    except KilnExit as e:  # a user mistake met mid-run, a non-finite loss, a SIGTERM stop, lost ranks
        return report(e)
    return DONE


def _no_quorum(trainer: Trainer) -> tuple[str, str]:
    """One line when a fault-tolerance quorum timed out: the lighthouse is gone (or fewer groups than its
    --min_replicas reach it); and what was lost, for the launcher."""
    rank, address = int(os.environ.get("RANK", 0)), os.environ.get("TORCHFT_LIGHTHOUSE")
    timeout = trainer.cfg.comm.init_timeout_seconds  # torchft's error says only "Timeout expired"
    line = (
        f"rank {rank} stopped in step {trainer.step}: no fault-tolerance quorum within comm.init_timeout_seconds = "
        f"{timeout} s: the lighthouse at TORCHFT_LIGHTHOUSE={address} is down, or fewer groups than its "
        "--min_replicas reach it; start it again, then the groups (each resumes from its newest complete checkpoint)"
    )
    return line, f"the torchft lighthouse at {address} (rank {rank} found out in step {trainer.step})"


def _lost_peers(trainer: Trainer, e: Exception) -> tuple[str, str] | None:
    """One line when `e` came with the loss of other ranks (they stopped beating, trainer/components/dist.py):
    which ranks and nodes, in which step, the backend's first line; and what was lost with where this rank found
    out, for the launcher. None when every rank is alive. This rank first says it is alive and leaving (its
    collective failed, it did not fail): the others then name only the ranks that died, even if torchrun stops
    this one while it looks."""
    if trainer.peers is None:
        return None
    trainer.peers.leave()
    lost = trainer.peers.lost_ranks()  # waits a few seconds: long enough to tell a gone rank from a busy one
    if lost == []:
        return None
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    reason = re.sub(r"^\[[^\]]*\] ", "", reason)  # gloo's "[.../pair.cc:537] " source position
    reason = reason if len(reason) <= 160 else reason[:157] + "..."
    rank = int(os.environ.get("RANK", 0))
    what = trainer.peers.describe(lost)
    # torchrun tells its ranks their restart budget; a rank started otherwise has none.
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)
    )
    then = (
        "torchrun restarts the job (MAX_RESTARTS) from the newest complete checkpoint"
        if restarts_left > 0
        else "no restarts left (MAX_RESTARTS); run it again to resume from the newest complete checkpoint"
    )
    line = f"rank {rank} stopped in step {trainer.step}: {what}; a collective failed ({reason}); {then}"
    return line, f"{what} (rank {rank} found out in step {trainer.step})"


if __name__ == "__main__":
    exit_now(main())
