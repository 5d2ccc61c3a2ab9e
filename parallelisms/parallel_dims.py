"""ParallelDims: the parallel degrees, validated against the world size, and the device mesh they build."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int  # -1 = the rest of the world size
    tp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, value in (("data_parallel_replicate_degree", self.dp_replicate), ("tensor_parallel_degree", self.tp)):
            if value < 1:
                raise ConfigError(f"parallelism.{name} must be >= 1, got {value}")
        others = self.dp_replicate * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"parallelism: data_parallel_replicate_degree x tensor_parallel_degree = {others} "
                    f"does not divide the world size {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1 or self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree ({self.dp_replicate}) x data_parallel_shard_degree "
                f"({self.dp_shard}) x tensor_parallel_degree ({self.tp}) must equal the world size "
                f"{self.world_size}"
            )

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
    def dp_degree(self) -> int:
        """Number of distinct data streams (ranks in one TP group see the same batch)."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 3-D mesh (dp_replicate, dp_shard, tp) with a flattened `dp` dimension for data loading."""
        mesh = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard, self.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )
        self._dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
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
