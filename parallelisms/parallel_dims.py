"""ParallelDims: the parallel degrees, validated against the world size, and the device mesh they build."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.args import ModelArgs, ffn_hidden_dim
from trainer.config import ActivationCheckpoint, ConfigError, Parallelism, Training, resolve_dp_shard
from trainer.internals import flatten_mesh


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int  # -1 = the rest of the world size
    tp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.dp_shard = resolve_dp_shard(self.dp_replicate, self.dp_shard, self.tp, self.world_size)

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


def validate_parallelism(
    dims: ParallelDims,
    model_args: ModelArgs,
    training: Training,
    parallelism: Parallelism,
    device_type: str,
    ac: ActivationCheckpoint | None = None,
) -> None:
    """Checks that need the degrees and the model shape; call before the model is built (exit 2 on failure)."""
    tp = dims.tp
    n_kv_heads = model_args.n_heads if model_args.n_kv_heads is None else model_args.n_kv_heads
    # Colwise wq/wk/wv shard whole heads; w1/w3 colwise and w2 rowwise shard the FFN hidden dim.
    for what, size in (
        ("n_heads", model_args.n_heads),
        ("n_kv_heads", n_kv_heads),
        ("FFN hidden dim", ffn_hidden_dim(model_args)),
    ):
        if size % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the model's {what} ({size})")
    # Sequence parallel (norms, embedding output) splits every sequence into tp equal pieces.
    if training.seq_len % tp:
        raise ConfigError(f"training.seq_len ({training.seq_len}) must be divisible by tensor_parallel_degree ({tp})")
    # (global batch vs local batch x dp degree is checked by the Trainer when it sets gradient accumulation.)
    if parallelism.enable_async_tensor_parallel:
        if device_type != "cuda":
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory); this run is on "
                f"{device_type} (gloo)"
            )
        if not dims.tp_enabled or not training.compile:
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1 and training.compile "
                "(the TP overlap is an inductor pass)"
            )
    block_ac = ac is not None and (ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option != "op"))
    if ac is not None and block_ac and dims.tp_enabled and training.compile and device_type == "cpu":
        # Known failure on the CPU build (torch 2.13), with FSDP too: a compiled TP block under whole-block
        # checkpointing fails in its first forward (AOTAutograd saves a DeviceMesh among the tensors for
        # backward). No AC and per-op SAC compile and train.
        raise ConfigError(
            f"tensor parallel + training.compile + activation_checkpoint.mode {ac.mode}"
            + (f" (selective_ac_option {ac.selective_ac_option})" if ac.mode == "selective" else "")
            + " fails in the first forward on CPU (a torch bug, docs/parallelisms.md); use activation_checkpoint"
            ".mode none or selective_ac_option op, or drop --training.compile"
        )
