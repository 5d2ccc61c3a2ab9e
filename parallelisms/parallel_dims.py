"""ParallelDims: the parallel degrees, validated against the world size, and the device mesh they build."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln_base.config import resolve_dp_shard
from kiln_base.internals import flatten_mesh


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int  # -1 = the rest of the world size
    tp: int
    world_size: int
    pp: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.dp_shard = resolve_dp_shard(self.dp_replicate, self.dp_shard, self.tp, self.world_size, self.pp)

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_degree(self) -> int:
        """Number of distinct data streams (the ranks of one TP group, and of one pipeline, see the same batch)."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh in torchtitan's order, outermost first: (pp, dp_replicate, dp_shard, tp), every dimension present
        (size 1 when off), with a flattened `dp` dimension for data loading. Consecutive ranks share the inner
        dimensions: TP within a node, pipeline stages across the slowest links."""
        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )
        self._dp_mesh = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        assert self._mesh is not None, "build_mesh() first"
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks (replicate x shard) flattened into one dimension."""
        assert self._dp_mesh is not None, "build_mesh() first"
        return self._dp_mesh

    @property
    def pp_mesh(self) -> DeviceMesh:
        """The ranks of this rank's pipeline: one per stage group, in stage order."""
        return self.mesh["pp"]
