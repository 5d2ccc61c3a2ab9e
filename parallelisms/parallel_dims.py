"""ParallelDims: the parallel degrees, validated against the world size, and the device mesh they build."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln_base.config import Degrees, resolve_dp_shard
from kiln_base.internals import flatten_mesh, unflatten_mesh


@dataclass
class ParallelDims:
    degrees: Degrees  # the run plan's (kiln_base.config.plan_run): the one place they are resolved and checked
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)  # flattened dimensions
    _experts: DeviceMesh | None = field(default=None, init=False, repr=False)  # dp_shard as (efsdp, ep), with EP

    @classmethod
    def of(cls, degrees: Degrees) -> ParallelDims:
        """The run plan's degrees, before the mesh is built."""
        return cls(degrees)

    @classmethod
    def for_world(
        cls, dp_replicate: int, dp_shard: int, tp: int, world_size: int, cp: int = 1, pp: int = 1, ep: int = 1
    ) -> ParallelDims:
        """Degrees given by hand (dp_shard -1: the rest of the world size), checked to multiply to it; `ep` must
        divide the resolved dp_shard x cp x tp, as a multiple of cp x tp (the plan checks it for a config)."""
        dp_shard = resolve_dp_shard(dp_replicate, dp_shard, tp, world_size, cp=cp, pp=pp)
        assert ep % (cp * tp) == 0 or ep == 1, f"expert_parallel_degree {ep} must be a multiple of cp x tp {cp * tp}"
        assert dp_shard % max(ep // (cp * tp), 1) == 0, f"expert_parallel_degree {ep} must divide dp_shard x cp x tp"
        return cls(Degrees(pp, dp_replicate, dp_shard, cp, tp, ep))

    @property
    def dp_replicate(self) -> int:
        return self.degrees.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.degrees.dp_shard

    @property
    def tp(self) -> int:
        return self.degrees.tp

    @property
    def cp(self) -> int:
        """Context parallel: ranks that split every sequence."""
        return self.degrees.cp

    @property
    def pp(self) -> int:
        """Pipeline parallel: ranks the model's stages are split over."""
        return self.degrees.pp

    @property
    def ep(self) -> int:
        """Expert parallel: ranks each MoE layer's routed experts are split over, borrowed from dp_shard."""
        return self.degrees.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def world_size(self) -> int:
        return self.degrees.world_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded: over dp_shard and the context-parallel ranks, which join FSDP's shard group."""
        return self.degrees.fsdp_shards > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fully_shard_enabled(self) -> bool:
        """Whether FSDP2's fully_shard wraps the model: data parallel (any flavour) or context parallel."""
        return self.dp_enabled or self.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_degree(self) -> int:
        """Number of distinct data streams (the ranks of one TP or CP group, and of one pipeline, see the same
        batch)."""
        return self.degrees.dp_degree

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh in torchtitan's order, outermost first: (pp, dp_replicate, dp_shard, cp, tp), every dimension
        present (size 1 when off). Consecutive ranks share the inner dimensions: TP within a node, pipeline stages
        across the slowest links. Flattened dimensions: `dp` (dp_replicate x dp_shard) for data loading and, with
        context parallelism, `dp_shard_cp` for FSDP's shard group and `dp_cp` for averaging the loss over every
        rank that holds different tokens."""
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        self._flat["dp"] = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        if self.cp_enabled:  # without CP they would equal dp_shard and dp: no extra process groups then
            self._flat["dp_shard_cp"] = flatten_mesh(mesh["dp_shard", "cp"], "dp_shard_cp")
            self._flat["dp_cp"] = flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp")
        if self.ep_enabled:  # the same ranks as dp_shard x cp x tp, EP innermost: an EP group is consecutive ranks
            inner = self.cp * self.tp
            if inner == 1:
                self._experts = unflatten_mesh(mesh, "dp_shard", (self.degrees.efsdp, self.ep), ("efsdp", "ep"))
            else:  # torchtitan's rule: an EP group is ep / (cp x tp) shard ranks with all their CP and TP ranks
                sizes = (self.degrees.efsdp, self.ep // inner)
                experts = unflatten_mesh(mesh, "dp_shard", sizes, ("efsdp", "dp_shard_in_ep"))
                self._flat["ep"] = flatten_mesh(experts["dp_shard_in_ep", "cp", "tp"], "ep")
                self._experts = experts
            if self.tp_enabled:  # an MoE layer's TP ranks route different tokens: its counts are summed over them too
                self._flat["dp_cp_tp"] = flatten_mesh(mesh["dp_replicate", "dp_shard", "cp", "tp"], "dp_cp_tp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        assert self._mesh is not None, "build_mesh() first"
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks (replicate x shard) flattened into one dimension: the data loader's."""
        assert self._flat, "build_mesh() first"
        return self._flat["dp"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What fully_shard shards over: dp_shard x cp flattened, as (dp_replicate, dp_shard_cp) for HSDP."""
        if not self.cp_enabled:
            return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate_enabled else self.mesh["dp_shard"]
        if not self.dp_replicate_enabled:
            return self._flat["dp_shard_cp"]
        with warnings.catch_warnings():
            # torch 2.13 warns that slicing a flattened dimension out of the root mesh "will be deprecated"; it is
            # torchtitan's HSDP x CP mesh too, and there is no other public way to pair dp_replicate with it.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return self.mesh["dp_replicate", "dp_shard_cp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks one MoE layer's routed experts are split over (consecutive dp_shard ranks; with context or
        tensor parallelism ep / (cp x tp) of them with all their CP and TP ranks)."""
        assert self._experts is not None, "build_mesh() with expert parallelism first"
        return self._flat["ep"] if "ep" in self._flat else self._experts["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """What fully_shard shards an expert-parallel rank's experts over: the dp_shard (x cp) ranks holding the
        same experts (efsdp = dp_shard x cp / ep), as (dp_replicate, efsdp) for HSDP."""
        assert self._experts is not None, "build_mesh() with expert parallelism first"
        return self._experts["dp_replicate", "efsdp"] if self.dp_replicate_enabled else self._experts["efsdp"]

    @property
    def loss_mesh(self) -> DeviceMesh:
        """Every rank holding different tokens of the global batch (dp_replicate x dp_shard x cp): the logged loss
        is their mean."""
        assert self._flat, "build_mesh() first"
        return self._flat["dp_cp" if self.cp_enabled else "dp"]

    @property
    def routing_mesh(self) -> DeviceMesh:
        """Every rank routing different tokens through an MoE layer: the loss mesh's ranks and, with expert
        parallelism under TP (each TP rank routes its part of the sequence), their TP ranks: the tokens-per-expert
        counts are summed over it."""
        return self._flat["dp_cp_tp"] if "dp_cp_tp" in self._flat else self.loss_mesh

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline's process group; None without pipeline parallelism."""
        return self.pp_mesh.get_group() if self.pp_enabled else None

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline (0 without pipeline parallelism)."""
        return self.pp_mesh.get_local_rank() if self.pp_enabled else 0

    @property
    def pp_mesh(self) -> DeviceMesh:
        """The ranks of this rank's pipeline: one per stage group, in stage order."""
        return self.mesh["pp"]
