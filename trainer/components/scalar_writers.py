"""Where kiln's scalars go: TensorBoard and Weights & Biases behind one `add_scalar(tag, value, step)`.

Every scalar kiln records is written through `ScalarWriters.add_scalar`: the step metrics (`kiln/loss`, `kiln/tps`,
... from MetricsLogger), the float8 numerics (`float8/<layer>/<operand>/<stat>` from float8/numerics_report.py) and
whatever is added later through the same writer. So a scalar TensorBoard gets, W&B gets too, under the same name
and step, without either caller knowing which writers are on.

    TensorBoard  metrics.enable_tensorboard: <dump_folder>/<save_tb_folder>/rank_N, on the logging ranks (every
                 rank with metrics.save_for_all_ranks)
    W&B          metrics.enable_wandb: one run per job, from the first rank LOG_RANK names; its files under
                 <dump_folder>/wandb/. torchtitan's environment variables (v0.2.2's WandBLogger) name the run:
                 WANDB_PROJECT (kiln's default "kiln"), WANDB_RUN_NAME (default: the dump folder's name),
                 WANDB_TEAM, and WANDB_RUN_ID, _RUN_NOTES, _RUN_TAGS (comma list), _RUN_GROUP, _RUN_JOB_TYPE,
                 WANDB_RESUME_FROM, WANDB_FORK_FROM. wandb itself reads WANDB_MODE (offline: no server needed).

wandb is imported only when asked for (it takes ~2 s); the config check refuses metrics.enable_wandb without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kiln_base.config import Metrics
from kiln_base.errors import ConfigError

logger = logging.getLogger("kiln")

WANDB_PROJECT = "kiln"  # torchtitan's default project is "torchtitan"

# torchtitan's environment variables -> wandb.init's arguments (torchtitan v0.2.2, components/metrics.py).
WANDB_ENV = (
    ("WANDB_TEAM", "entity"),
    ("WANDB_PROJECT", "project"),
    ("WANDB_RUN_NAME", "name"),
    ("WANDB_RUN_ID", "id"),
    ("WANDB_RUN_NOTES", "notes"),
    ("WANDB_RUN_TAGS", "tags"),
    ("WANDB_RUN_GROUP", "group"),
    ("WANDB_RUN_JOB_TYPE", "job_type"),
    ("WANDB_RESUME_FROM", "resume_from"),
    ("WANDB_FORK_FROM", "fork_from"),
)


class ScalarWriter(Protocol):
    def add_scalar(self, tag: str, value: float, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class ScalarWriters:
    """Every writer that is on, behind one add_scalar (TensorBoard's signature)."""

    def __init__(self, writers: Sequence[ScalarWriter]) -> None:
        self.writers = list(writers)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for w in self.writers:
            w.add_scalar(tag, value, step)

    def flush(self) -> None:
        """Hand what was written so far to the writers' files (and W&B's service): once per log step."""
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


class WandbWriter:
    """A W&B run fed scalar by scalar: the scalars of one step are sent as one row, `run.log(row, step=step)`.

    One `run.log` per scalar costs ~0.1 ms; a float8 numerics step writes thousands of scalars on a large model.
    A row is sent when a later step's first scalar arrives, at `flush` (MetricsLogger's log steps) and at close;
    W&B merges rows sent for the same step, so a scalar written after a flush still lands in its step."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.step: int | None = None
        self.row: dict[str, float] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if step != self.step:
            self.flush()
            self.step = step
        self.row[tag] = value

    def flush(self) -> None:
        if self.row:
            self.run.log(self.row, step=self.step)
            self.row = {}

    def close(self) -> None:
        self.flush()
        self.run.finish()


def wandb_init_args(env: Mapping[str, str], dump_folder: str) -> dict[str, Any]:
    """wandb.init's keyword arguments from torchtitan's environment variables (those set), with kiln's defaults."""
    args: dict[str, Any] = {arg: env[var] for var, arg in WANDB_ENV if env.get(var)}
    args.setdefault("project", WANDB_PROJECT)
    args.setdefault("name", os.path.basename(os.path.normpath(dump_folder)))
    if "tags" in args:
        args["tags"] = [t.strip() for t in args["tags"].split(",") if t.strip()]
    return args


def _wandb_setting(error: Mapping[str, Any]) -> str:
    """One of pydantic's errors for W&B's settings as the user set it: `WANDB_MODE='bogus': Input should be ...`."""
    field = "_".join(map(str, error.get("loc", ())))
    var = f"WANDB_{field.upper()}"
    where = f"{var}={os.environ[var]!r}" if var in os.environ else f"{field}={error.get('input')!r}"
    return f"{where}: {error.get('msg', 'invalid')}"


def open_wandb(dump_folder: str, config: dict[str, Any]) -> WandbWriter:
    """Start the job's W&B run, recording `config` (the merged config) with it; ConfigError when wandb refuses
    (online without `wandb login`: the message says so)."""
    import wandb  # lazy: ~2 s, and only installed with the wandb extra

    os.makedirs(dump_folder, exist_ok=True)  # wandb writes <dir>/wandb/<run>
    try:
        run = wandb.init(dir=dump_folder, config=config, **wandb_init_args(os.environ, dump_folder))
    except wandb.errors.Error as e:
        offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
        advice = (
            "W&B runs offline here, no login involved: check the WANDB_* variables"
            if offline
            else "log in with `wandb login` or WANDB_API_KEY, or set WANDB_MODE=offline"
        )
        raise ConfigError(
            f"metrics.enable_wandb: W&B could not start a run: {' '.join(str(e).split())} ({advice})"
        ) from None
    except ValueError as e:  # pydantic's ValidationError: a setting W&B rejects, from a WANDB_* variable
        errors = e.errors() if callable(getattr(e, "errors", None)) else []  # type: ignore[attr-defined]
        bad = [_wandb_setting(err) for err in errors] or [" ".join(str(e).split())]
        raise ConfigError(f"metrics.enable_wandb: W&B rejects its settings: {'; '.join(bad)}") from None
    logger.info(
        f"Weights & Biases: run '{run.name}' in project '{run.project}' (mode {run.settings.mode}), "
        f"files in {run.settings.sync_dir}"
    )
    return WandbWriter(run)


def open_scalar_writers(
    cfg: Metrics, dump_folder: str, config: dict[str, Any], rank: int, log_ranks: Sequence[str]
) -> ScalarWriters | None:
    """The writers this rank feeds (None: no scalar is written here). `log_ranks`: LOG_RANK's entries."""
    writers: list[ScalarWriter] = []
    logging_rank = str(rank) in log_ranks
    if cfg.enable_tensorboard and (logging_rank or cfg.save_for_all_ranks):
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is slow to import

        writers.append(SummaryWriter(os.path.join(dump_folder, cfg.save_tb_folder, f"rank_{rank}")))
    if cfg.enable_wandb and log_ranks and str(rank) == log_ranks[0]:  # one W&B run per job
        writers.append(open_wandb(dump_folder, config))
    return ScalarWriters(writers) if writers else None
