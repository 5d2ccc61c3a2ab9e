"""How each parameter is initialised: one elementwise rule per parameter, named by its FQN."""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is initialised: `normal` (mean 0, `std`), `trunc_normal` (mean 0, `std`, cut at +-`cut`
    stds) or `ones`. Elementwise, so any slice of a tensor can be filled on its own (the layout-independent init of
    parallelisms/seeded_init.py fills each rank's shard from the full tensor's values)."""

    kind: str
    std: float = 1.0
    cut: float = 2.0  # nn.init.trunc_normal_'s default bounds are +-2 (absolute): see `fill_`

    def fill_(self, t: torch.Tensor, generator: torch.Generator | None = None) -> None:
        if self.kind == "ones":
            nn.init.ones_(t)
        elif self.kind == "normal":
            nn.init.normal_(t, mean=0.0, std=self.std, generator=generator)
        else:
            bound = self.cut * self.std
            nn.init.trunc_normal_(t, mean=0.0, std=self.std, a=-bound, b=bound, generator=generator)


def trunc(std: float) -> ParamInit:
    """torchtitan's Linear init: trunc_normal_(std) with nn.init's default bounds a=-2, b=2 (absolute, so at these
    small stds nothing is cut)."""
    return ParamInit("trunc_normal", std, cut=2.0 / std)
