"""Relative error of each float8 recipe's three GEMMs against fp32, on one Linear (the numbers in docs/float8.md).

    python scripts/float8_gemm_error.py [--m 1024 --k 256 --n 256]

Forward output, grad_input and grad_weight of a Float8Linear vs the same Linear in fp32, with the same
upstream gradient fed to both, so each GEMM's error is its own. Real kernel (torch._scaled_mm), no emulation.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from float8.converter import Float8Converter  # noqa: E402
from kiln_base.config import Float8  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=1024, help="tokens")
    p.add_argument("--k", type=int, default=256, help="in_features")
    p.add_argument("--n", type=int, default=256, help="out_features")
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.m, args.k)
    w = torch.randn(args.n, args.k) / args.k**0.5
    g = torch.randn(args.m, args.n)  # upstream gradient, identical for both
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = xr @ wr.t()
    yr.backward(g)
    print("| recipe | output | grad_input | grad_weight |\n| --- | --- | --- | --- |")
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        model = nn.Sequential(nn.Linear(args.k, args.n, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(w)
        Float8Converter(Float8(enable_float8_linear=True, recipe_name=recipe, filter_fqns=[])).convert(model)
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(g)
        errs = (rel(y, yr), rel(xi.grad, xr.grad), rel(model[0].weight.grad, wr.grad))
        print(f"| {recipe} | " + " | ".join(f"{100 * e:.2f}%" for e in errs) + " |")


if __name__ == "__main__":
    main()
