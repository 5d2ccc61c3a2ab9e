"""Fault tolerance on TorchFT ([fault_tolerance], synchronous mode): this rank's side of a job of replica groups.

Each replica group is its own run_train.sh job (FSDP, TP, float8, AC and compile inside it, as without FT). It
wraps the training step (trainer/step/step.py StepWrapper). Every step the groups meet in a quorum through torchft's
lighthouse (TORCHFT_LIGHTHOUSE): `start` asks for it, and a
restarted group that is behind the others heals there, receiving the live weights, optimizer and LR-schedule state
and the step count from a peer group over torchft's checkpoint transport (HTTP, not the disk). After backward,
`gradients_ready` averages this rank's gradient shards and the loss with the same rank of every other live group
through torchft's Manager (its own gloo or nccl process group, reconfigured at each new quorum); `may_update` says
whether the step may be applied: when a group died during the step the all-reduce fails, no group applies it, and
the next quorum goes on without the dead group (a smaller global batch).

With semi_sync_method local_sgd the groups step alone and torchft's LocalSGD, hooked on the optimizer (its step runs
inside the step's update, after `around_update` told the Manager the training step), meets them every sync_steps
steps: a quorum (where a restarted group heals) and the weights averaged over the live groups. With diloco
torchft's DiLoCo meets them every sync_steps / fragments steps, one model fragment (the plan's) at a time: a quorum,
then the fragment's pseudo-gradient (its weights at its last sync minus this group's weights now) averaged over the
live groups and applied to the last sync's weights by an outer Nesterov SGD (torchtitan's: lr 0.7, momentum 0.9).

torchft is imported only here and only with fault_tolerance.enable (pip install -e '.[ft]').
docs/fault_tolerance.md says how to launch a job and what happens to a group's samples while it is down.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kiln_base.config import FaultTolerance
from kiln_base.errors import ConfigError, UserError
from trainer.checkpoint.resume import TrainState
from trainer.step.step import StepWrapper

logger = logging.getLogger("kiln")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def _local(value: Any) -> Any:
    """A state dict with every DTensor replaced by this rank's shard (what crosses to the same rank of a peer)."""
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):  # a snapshot: the transport may send it while this group trains on
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def shared_settings(ft: FaultTolerance, fragments: tuple[tuple[str, ...], ...] | None) -> dict[str, Any]:
    """What every replica group of a job must run alike (a healing group compares its own with its peer's): the
    number of groups and the semi-synchronous schedule (DiLoCo's resolved fragments, whichever key gave them)."""
    key = "fault_tolerance."
    settings: dict[str, Any] = {f"{key}group_size": ft.group_size, f"{key}semi_sync_method": ft.semi_sync_method}
    if ft.semi_sync_method is not None:
        settings[f"{key}sync_steps"] = ft.sync_steps
    if ft.semi_sync_method == "diloco":
        settings[f"{key}module_fqns_per_model_fragment"] = [list(f) for f in fragments or ()]
        for name in ("fragment_sync_delay", "fragment_update_alpha", "should_quantize"):
            settings[f"{key}{name}"] = getattr(ft, name)
    return settings


def identified(ft: FaultTolerance, pg_class: type) -> tuple[str, type]:
    """This group's name in the quorum and its process-group class, which refuses a replica_id another live group
    holds (two groups started with one id would read the same samples and skip another group's, as one job).

    torchft appends a random uuid to the name, so its lighthouse never sees two groups as one; the name's own
    trailing digits are the replica_id (torchft's global ranks: replica_id x group world size + rank). The name
    begins with the time this group started, and the quorum lists its members sorted by name, so at every new quorum
    (torchft reconfigures the process group with its members' global ranks, this group's at `rank`) a group finds
    whether one that started before it holds its id. Only the later one stops: the error is recorded by torchft's
    Manager (this group joins no collective of the quorum: nothing of it is committed anywhere) and raised by
    should_commit in the main thread; the earlier group's step fails, and it trains on without the later one."""
    started = time.time_ns()

    class Identified(pg_class):
        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )
            if not global_ranks or not group_world_size or global_ranks[rank] not in global_ranks[:rank]:
                return
            live = sorted({g // group_world_size for g in global_ranks})
            free = [i for i in range(ft.group_size) if i not in live]
            raise ConfigError(
                f"fault_tolerance.replica_id = {ft.replica_id} is taken: a replica group started before this one "
                f"with the same id is live in the quorum (every group of a job needs its own id in [0, group_size) "
                f"= [0, {ft.group_size}); live: {', '.join(map(str, live))}); start this group with a free id"
                + (f" ({', '.join(map(str, free))})" if free else "")
            )

    return f"kiln_ft_t{started:020d}_{ft.replica_id}", Identified


def _why(error: Any) -> str:
    """The first words of a failed collective's error (torchft's ExceptionWithTraceback); gloo's: "[.../pair.cc:537]
    Read error [host]:port: Connection reset by peer. ..." -> "Read error [host]:port: Connection reset by peer"."""
    return str(error.original_exception).splitlines()[0].rpartition("] ")[2].split(". ")[0]


class ReplicaGroup(StepWrapper):
    """This rank's member of the TorchFT job: the Manager, the step's quorum, the gradient average and the commit."""

    def __init__(
        self,
        ft: FaultTolerance,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        progress: TrainState,
        group_batch: int,
        quorum_timeout_seconds: int,
        init_sync: bool,
        fragments: tuple[tuple[str, ...], ...] | None = None,
    ) -> None:
        """`progress`: the run's step counter, which a healing group moves; `group_batch`: the sequences one group
        trains on per step; `init_sync`: the first quorum syncs every group's weights (unseeded groups drew
        different ones)."""
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager server logs every quorum and commit at info
        # kiln's own lines say what changed and what failed (torchft logs a traceback per failed all-reduce at ERROR)
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.ft, self.model, self.optimizer, self.lr_scheduler = ft, model, optimizer, lr_scheduler
        self.progress, self.group_batch = progress, group_batch
        self.settings = shared_settings(ft, fragments)
        self.fragments, self.resumed = fragments, progress.step > 0  # resumed from this group's checkpoint
        # DiLoCo resumed from this group's checkpoint: its first quorum syncs it (see _diloco)
        self.manager = self._manager(quorum_timeout_seconds, init_sync or (self.diloco and self.resumed))
        self.participants = 0
        self.committed = True
        self.failed: object = None  # the last failed sync's error (semi-synchronous), said once
        self.semi_sync = contextlib.ExitStack()
        self.sync_count = lambda: self.progress.step  # the step the next sync's quorum compares (LocalSGD: the step)
        if ft.semi_sync_method == "local_sgd":
            from torchft.local_sgd import LocalSGD

            self.semi_sync.enter_context(LocalSGD(self.manager, model, optimizer, sync_every=ft.sync_steps))
        elif self.diloco:
            self.semi_sync.enter_context(self._diloco())
        self.resume_at(progress.step)

    def _manager(self, quorum_timeout_seconds: int, init_sync: bool) -> Any:
        """torchft's Manager of this rank, once the lighthouse answers (every rank asks, so that all end with this
        line at once: a rank left waiting for rank 0's manager in the store takes no SIGTERM until torchrun kills it
        30 s later)."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft._torchft import LighthouseClient

        ft = self.ft
        timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
        lighthouse = os.environ[LIGHTHOUSE_ENV]
        try:
            LighthouseClient(lighthouse, connect_timeout=timeout)
        except RuntimeError:
            raise ConfigError(
                f"fault_tolerance: no torchft lighthouse answers at {LIGHTHOUSE_ENV}={lighthouse} within "
                f"process_group_timeout_ms = {ft.process_group_timeout_ms}; start one first (torchft_lighthouse "
                "--min_replicas 1, docs/fault_tolerance.md) or fix the address"
            ) from None
        if ft.process_group == "nccl" and not torch.cuda.is_available():
            raise ConfigError('fault_tolerance.process_group = "nccl" needs CUDA GPUs; on a CPU use "gloo"')
        name, pg_class = identified(ft, ProcessGroupGloo if ft.process_group == "gloo" else ProcessGroupNCCL)
        pg = pg_class(timeout=timeout)
        return Manager(
            pg=pg,
            min_replica_size=ft.min_replica_size,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            use_async_quorum=False,  # a healing group loads the peer's state before its forward: it trains in step
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_seconds),
            connect_timeout=timeout,
            replica_id=name,
            init_sync=init_sync,
        )

    @property
    def diloco(self) -> bool:
        return self.ft.semi_sync_method == "diloco"

    def _log_failed_sync(self) -> None:
        """A semi-synchronous sync whose all-reduce failed (a group died in it): once per failure, as may_update
        says it of a synchronous step."""
        error = self.manager.errored()
        if error is not None and error is not self.failed:
            self.failed = error
            logger.warning(
                f"fault tolerance: the sync in step {self.progress.step} failed ({_why(error)}); not applied, the next "
                "sync goes on without the lost replica group"
            )

    def _diloco(self) -> Any:
        """torchft's DiLoCo on the optimizer, one fragment (a module dict of the model's modules, the same parameters)
        and one outer optimizer per fragment of the plan."""
        from torchft.local_sgd import DiLoCo

        ft, fragments = self.ft, self.fragments
        assert fragments, "the plan's DiLoCo fragments (kiln_base.config.plan.diloco_fragments)"
        parts = [nn.ModuleDict({fqn.replace(".", "_"): self.model.get_submodule(fqn) for fqn in f}) for f in fragments]
        per = ft.sync_steps // len(parts)
        first_quorum = per - ft.fragment_sync_delay  # DiLoCo's: this process's optimizer steps before it
        updates = itertools.count(1)

        def sync_count() -> int:
            """The quorum compares the syncs the training step implies (step s ends sync (s - 1) // per; DiLoCo picks
            its fragment from that count), not the syncs this process made: a restarted group, behind the others
            whatever it did alone, heals at its first sync, then picks the others' fragment. A group resumed from its
            own checkpoint has no outer state (each fragment's weights at its last sync, the outer momentum: not in
            kiln's checkpoints): up to its first quorum it claims sync 0, so that it heals there from a live group,
            or, when every group resumed at once, all from one of them (init_sync)."""
            first = next(updates) <= first_quorum
            return 0 if self.resumed and first else (self.progress.step - 1) // per

        self.sync_count = sync_count
        # torchtitan's outer optimizer (torchtitan/components/ft/manager.py, v0.2.2): the DiLoCo paper's choice
        outer = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts]
        return DiLoCo(
            self.manager,
            parts,
            self.optimizer,
            outer,
            sync_every=ft.sync_steps,
            should_quantize=ft.should_quantize,
            fragment_sync_delay=ft.fragment_sync_delay,
            fragment_update_alpha=ft.fragment_update_alpha,
        )

    # ------------------------------------------------------------------ what a healing group receives

    def _state_dict(self) -> dict[str, Any]:
        return {
            "model": _local(self.model.state_dict()),
            "optimizer": _local(self.optimizer.state_dict()),
            "lr_scheduler": _local(self.lr_scheduler.state_dict()),
            "step": self.progress.step,
            "settings": self.settings,
        }

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        """A live peer's state, copied into this rank's shards (the same layout: the same rank of a group of the
        same shape), bitwise. A peer that runs other settings (a group restarted with another sync_steps, say) is
        refused: this group would take its weights at every sync and train on as if it belonged to the job."""
        for key, theirs in state["settings"].items():
            if self.settings[key] != theirs:
                raise ConfigError(
                    f"{key} is {self.settings[key]} in replica group {self.ft.replica_id} but {theirs} in the live "
                    "group it heals from: every group of a job must run the same; start this group again with "
                    f"{theirs} (or stop every group and start them all with one value)"
                )
        ours = self.model.state_dict()
        for key, value in state["model"].items():
            target = ours[key]
            (target.to_local() if isinstance(target, DTensor) else target).copy_(value)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, saved in state["optimizer"]["state"].items():
            p = params[index]
            entry = {}
            for key, value in saved.items():
                if isinstance(p, DTensor) and torch.is_tensor(value) and value.dim() > 0:
                    value = DTensor.from_local(
                        value.to(p.device),
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                entry[key] = value
            self.optimizer.state[p] = entry
        for group, saved in zip(self.optimizer.param_groups, state["optimizer"]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.progress.step = int(state["step"])
        logger.info(
            f"fault tolerance: healed from a live replica group: weights, optimizer and lr of step {state['step']}"
        )

    # ------------------------------------------------------------------ the step

    @property
    def synchronous(self) -> bool:
        return self.ft.semi_sync_method is None

    def resume_at(self, step: int) -> None:
        """The step the next quorum compares: the training step (after a resume from this group's own checkpoint;
        under LocalSGD before each sync), under DiLoCo the sync count."""
        self.manager.load_state_dict({**self.manager.state_dict(), "step": step})

    def start(self, progress: TrainState) -> None:
        """The quorum of this step (a group behind the others heals here: progress moves); logs when the live groups
        change. Semi-synchronous, the quorum is the sync's: this only logs what the last sync found."""
        if not self.synchronous:
            n = self.manager.num_participants()  # 0 before the first sync
            if n and n != self.participants:
                logger.info(
                    f"fault tolerance: the sync before step {progress.step + 1}: {n} of {self.ft.group_size} "
                    "replica groups live"
                )
                self.participants = n
            return
        before = progress.step
        self.manager.start_quorum()
        n = self.manager.num_participants()
        if progress.step != before:
            logger.info(f"fault tolerance: replica group {self.ft.replica_id} rejoined at step {progress.step + 1}")
        if n != self.participants:
            logger.info(
                f"fault tolerance: step {progress.step + 1}: {n} of {self.ft.group_size} replica groups live; global "
                f"batch {n * self.group_batch} sequences"
            )
            self.participants = n

    def gradients_ready(self, loss: torch.Tensor) -> torch.Tensor:
        """Average this rank's gradient shards and `loss` with the same rank of every live group (one all-reduce);
        returns the averaged loss. A failure (a group died) is recorded by the Manager and denies the commit.
        Semi-synchronous, each group steps on its own gradients (the weights meet at the syncs): nothing to do."""
        if not self.synchronous:
            return loss
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        shards = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([s.reshape(-1).float() for s in shards] + [loss.detach().reshape(1).float()])
        self.manager.allreduce(flat).wait()
        offset = 0
        for s in shards:
            s.copy_(flat[offset : offset + s.numel()].view_as(s))
            offset += s.numel()
        return flat[-1].to(loss.dtype)

    def may_update(self, step: int) -> bool:
        """Whether every live group completed this step (the optimizer may step); logs a step that is dropped.
        Semi-synchronous, a group's own step always is (a sync that fails is not applied: torchft's LocalSGD). A
        user mistake found at the last quorum (`identified`) is raised here."""
        error = self.manager.errored()
        if error is not None and isinstance(error.original_exception, UserError):
            raise error.original_exception
        if not self.synchronous:
            return True
        self.committed = self.manager.should_commit()
        if not self.committed:
            error = self.manager.errored()
            why = "too few replica groups live (fault_tolerance.min_replica_size)" if error is None else _why(error)
            logger.warning(
                f"fault tolerance: step {step} not committed ({why}); the next quorum goes on without the lost "
                "replica group"
            )
        return self.committed

    @contextlib.contextmanager
    def around_update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Iterator[None]:
        """Semi-synchronous: the optimizer step runs LocalSGD's or DiLoCo's sync (their hooks on it); its quorum
        compares the step (the sync count under DiLoCo) set here, so a group behind the others heals at the sync
        whatever syncs it made alone."""
        if not self.synchronous:
            self.resume_at(self.sync_count())
        yield

    def after_update(self, step: int) -> None:
        if not self.synchronous:
            self._log_failed_sync()

    def close(self) -> None:
        self.semi_sync.close()
        self.manager.shutdown(wait=False)
