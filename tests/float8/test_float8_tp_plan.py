"""The float8 tensor-parallel plan as built, not as printed: on 2 gloo ranks, the styles on every TP-sharded
Linear, the weights' shard dims, and what actually reaches each module in forward (DTensor placement, float8
payload or high precision). Tensorwise must all-gather activations in float8 (torchao's Float8 styles); rowwise
recipes use the high-precision styles."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.common import tiny_run_args
from tests.helpers.distributed import run_distributed

LAYERS, SEQ, BATCH = 2, 32, 2
COLWISE, ROWWISE = (
    ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
    (
        "attention.wo",
        "feed_forward.w2",
    ),
)
PREPARED = ("attention", "feed_forward")  # the sub-modules whose input is redistributed (all-gathered)


def _describe(x: Any) -> tuple[str, str, str, tuple[int, ...]]:
    """(placements, local tensor class, payload dtype, local shape) of a module input."""
    if not isinstance(x, DTensor):
        return ("not a DTensor", type(x).__name__, str(x.dtype), tuple(x.shape))
    local = x._local_tensor
    payload = local._data.dtype if hasattr(local, "_data") else local.dtype  # Float8TrainingTensor: its bytes
    return (str(tuple(x.placements)), type(local).__name__, str(payload), tuple(local.shape))


def _plan_rank(recipes: list[str]) -> dict[str, dict[str, Any]]:
    from float8.converter import build_float8_converter
    from kiln_base.config import parse_args
    from parallelisms.parallel_dims import ParallelDims
    from trainer.build import build_model, model_args

    out = {}
    for recipe in recipes:
        cfg = parse_args(
            tiny_run_args(
                *("--model.n_layers", str(LAYERS), "--parallelism.tensor_parallel_degree", "2"),
                *("--float8.enable_float8_linear", "--float8.recipe_name", recipe),
            )
        )
        dims = ParallelDims.for_world(1, -1, 2, dist.get_world_size())
        dims.build_mesh("cpu")
        args = model_args(cfg.model, cfg.training.seq_len, 2256)
        built = build_model(cfg, args, dims, build_float8_converter(cfg.float8))  # the Trainer's build path
        model = built.model
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
        seen: dict[str, tuple] = {}

        def record(name: str, mod: torch.nn.Module, args: tuple, seen: dict[str, tuple] = seen) -> None:
            seen.setdefault(name, _describe(args[0]))  # returns None: the module's input is left as it is

        for name, mod in model.named_modules():
            if name.split(".", 2)[-1] in COLWISE + ROWWISE + PREPARED:
                # Registered after the TP styles' own pre-hooks, so this sees the input the module computes with.
                mod.register_forward_pre_hook(functools.partial(record, name))
        tokens = torch.randint(0, 2256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        model(tokens)
        weights = {
            name: (type(mod).__name__, str(tuple(mod.weight.placements)))
            for name, mod in model.named_modules()
            if name.split(".", 2)[-1] in COLWISE + ROWWISE
        }
        styles = {fqn: type(style).__name__ for fqn, style in built.tp_plan.items()}
        out[recipe] = {"inputs": seen, "weights": weights, "styles": styles}
    return out


@pytest.mark.distributed
def test_float8_tp_styles_and_module_inputs() -> None:
    results = run_distributed(_plan_rank, 2, ["tensorwise", "rowwise"])
    for rank in results:
        for recipe, got in rank.items():
            fp8 = recipe == "tensorwise"
            local = "Float8TrainingTensor" if fp8 else "Tensor"
            payload = "torch.float8_e4m3fn" if fp8 else "torch.float32"
            for i in range(LAYERS):
                for sub in PREPARED:
                    fqn = f"layers.{i}.{sub}"
                    assert got["styles"][fqn] == ("PrepareFloat8ModuleInput" if fp8 else "PrepareModuleInput"), fqn
                    # The whole sequence (all-gathered from Shard(1)), already float8 for tensorwise: the
                    # all-gather moved float8 bytes.
                    assert got["inputs"][fqn] == ("(Replicate(),)", local, payload, (BATCH, SEQ, 256)), (recipe, fqn)
                for lin in COLWISE + ROWWISE:
                    fqn = f"layers.{i}.{lin}"
                    col = lin in COLWISE
                    want = ("Float8" if fp8 else "") + ("ColwiseParallel" if col else "RowwiseParallel")
                    assert got["styles"][fqn] == want, (recipe, fqn)
                    assert got["weights"][fqn] == ("Float8Linear", "(Shard(dim=0),)" if col else "(Shard(dim=1),)")
                    placement, local_cls, dtype, shape = got["inputs"][fqn]
                    # Column-wise: the whole gathered sequence; row-wise: this rank's half of the feature dim.
                    want_placement = "(Replicate(),)" if col else "(Shard(dim=2),)"
                    assert (placement, local_cls, dtype) == (want_placement, local, payload), (recipe, fqn, shape)
                    assert shape[:2] == (BATCH, SEQ) and (shape[2] == 256 or not col), (recipe, fqn, shape)
