"""The mixture-of-experts FFN: a router, grouped routed experts, optional shared experts. Dropless.

Per token the router scores every expert (softmax or sigmoid of a bias-free Linear), picks the top k by score plus
`expert_bias` (DeepSeek-V3's auxiliary-loss-free balancing: the bias moves the choice, never the weights), and
weighs the k experts' outputs by their scores (renormalised to sum 1 with `route_norm`, times `route_scale`).
Every token reaches its k experts: there is no capacity and nothing is dropped.

The routed experts' weights are 3-D parameters [E, out, in] (nn.Linear's layout per expert, so FSDP and expert
parallelism shard dim 0, the experts): w1 and w3 [E, hidden, dim], w2 [E, dim, hidden]. The (token, expert) pairs
are sorted by expert and computed with `torch._grouped_mm` over the experts' contiguous row groups where it runs
(`grouped_mm_runs`), else with a loop over the experts; the two give the same result. The grouped GEMM is the experts'
`gemm` (a `GroupedGemm`): float8 on the experts (float8/experts.py) swaps in torchao's scaled grouped GEMMs, which
need each expert's rows padded with zero rows to a multiple of 16 or 32 (`padded_groups`).

Balancing, read by the training step after the forward (nothing here changes the step):
- `tokens_per_expert` (buffer [E], float32): (token, expert) pairs routed to each expert since `reset_counts`;
  the step all-reduces it and calls `update_expert_bias` after each optimizer step. An in-place buffer update:
  torch.compile (fullgraph, also of a checkpointed block) captures it. Eager activation checkpointing replays it
  in the recompute, doubling the counts of a recomputed layer; the bias step is unchanged by that (it depends on
  the counts' signs against their mean only), and so is max/mean.
- The routing statistics: MoE.forward returns them beside its output, as a tensor (ROUTER_STATS rows), and the
  block passes them on; Transformer.forward collects them in eager code (`Transformer.router_stats`), from which
  `load_balance_loss` computes transformers' Qwen3-MoE auxiliary loss over all MoE layers. A tensor output, not
  an attribute set inside the layer: a Python side effect inside a checkpointed block is refused by
  torch.compile(fullgraph=True) ("unsafe side effect" in the checkpoint operator), an output is not.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kiln_base.internals import grouped_mm
from models.args import ModelArgs
from models.init import ParamInit, trunc

# One MoE layer's routing in one forward, a [2, E] float32 tensor: row 0 the fraction of the tokens routed to each
# expert (no gradient; sums to top_k), row 1 the router's probability of each expert averaged over the tokens
# (carries the gradient; sums to 1). What the auxiliary balance loss needs.
ROUTER_STATS = ("fraction_routed", "mean_probability")


def grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor, eager: bool = False) -> bool:
    """Whether torch._grouped_mm computes on these operands: bf16 on CUDA, float32 or bf16 on CPU (torch 2.13;
    under torch.compile bf16 only: its meta kernel refuses float32), with every row 16-byte aligned (the kernels'
    stride rule: dim and hidden multiples of 8 in bf16, 4 in fp32). `eager`: the call runs eagerly even inside a
    compiled graph (in a custom op, opaque to torch.compile), so the eager rule holds."""
    bf16_only = x.device.type == "cuda" or (torch.compiler.is_compiling() and not eager)
    ok_dtypes = (torch.bfloat16,) if bf16_only else (torch.float32, torch.bfloat16)
    if x.device.type not in ("cpu", "cuda") or x.dtype not in ok_dtypes:
        return False
    return all(w.dtype == x.dtype and all(n * x.element_size() % 16 == 0 for n in w.shape[1:]) for w in weights)


class GroupedGemm:
    """The experts' grouped GEMM: x (rows, in) sorted by expert, w_t (E, in, out), offs (E,) int32 group ends ->
    (rows, out). This one is `torch._grouped_mm` in the compute dtype. float8 on the experts gives a GroupedExperts
    a subclass (float8/experts.py) running torchao's scaled grouped GEMMs, whose groups of rows must be padded to
    `group_multiple` rows (16 for float8 rowwise, 32 for MXFP8: 16-byte aligned float8 rows, whole scale blocks)."""

    group_multiple = 1

    def runs(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """Whether this GEMM computes on these operands (else the experts loop over F.linear)."""
        return grouped_mm_runs(x, *weights)

    def __call__(self, x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x, w_t, offs)


HIGH_PRECISION = GroupedGemm()  # stateless: one instance serves every layer


class GroupedExperts(nn.Module):
    """E SwiGLU experts, w2(silu(w1 x) * w3 x) each, applied to tokens grouped by expert."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = use_grouped_mm
        self.gemm: GroupedGemm = HIGH_PRECISION  # float8's converter may swap in a low-precision one

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, dim): rows sorted by expert, `counts` [E] int64 of them per expert -> (rows, dim)."""
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3, self.use_grouped_mm, gemm=self.gemm)


def padded_groups(
    x: torch.Tensor, counts: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's rows of x (sorted by expert) followed by zero rows up to a multiple of `multiple`, without a
    host sync: (the padded rows, offs (E,) int32 group ends, each row of x's index in the padded rows).

    The padded rows number a bound known without reading `counts`, round_up(rows + E * (multiple - 1), multiple);
    the last group takes the spare zero rows, so no row lies past the last group end (a grouped GEMM leaves such
    rows unwritten). At most E * multiple extra rows: 2,048 for 128 experts in float8, under 1% of 30B-A3B's rows
    at 8 x 4096 tokens, top 8. Zero rows add nothing to a weight gradient and their outputs are dropped."""
    rows, n = x.shape[0], counts.numel()
    total = -(-(rows + n * (multiple - 1)) // multiple) * multiple
    padded = (counts + multiple - 1) // multiple * multiple
    ends = torch.cumsum(padded, 0)
    offs = torch.cat([ends[:-1], ends.new_full((1,), total)]).to(torch.int32)
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)  # padded start - unpadded start, per expert
    expert = torch.repeat_interleave(torch.arange(n, device=x.device), counts, output_size=rows)
    dest = torch.arange(rows, device=x.device) + shift[expert]
    return x.new_zeros(total, x.shape[1]).index_copy(0, dest, x), offs, dest


def swiglu_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    use_grouped_mm: bool,
    *,
    gemm: GroupedGemm = HIGH_PRECISION,
) -> torch.Tensor:
    """GroupedExperts' computation on the weights given (an expert-parallel rank passes its own experts'):
    x (rows, dim) sorted by expert, `counts` [w1.shape[0]] int64 rows per expert -> (rows, dim)."""
    if use_grouped_mm and gemm.runs(x, w1, w2, w3):
        if gemm.group_multiple > 1:
            x, offs, dest = padded_groups(x, counts, gemm.group_multiple)
        else:  # offs: each group's end row, on the device: no host sync (the loop's .tolist() is one).
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(gemm(x, w1.transpose(-2, -1), offs)) * gemm(x, w3.transpose(-2, -1), offs)
        out = gemm(h, w2.transpose(-2, -1), offs)
        return out[dest] if gemm.group_multiple > 1 else out
    outs = [
        F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
        for e, rows in enumerate(torch.split(x, counts.tolist()))
    ]
    return torch.cat(outs)


class TokenChoiceRouter(nn.Module):
    """Scores each token against every expert and picks its top k ("token choice")."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str, route_norm: bool, scale: float) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, scale

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (weights (tokens, k), experts (tokens, k) int64, probabilities (tokens, E) float32).

        `expert_bias` [E] is added to the scores for the choice only: the weights are the unbiased scores."""
        logits = self.gate(x).float()  # float32 routing, as transformers does, whatever the compute dtype
        scores = torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        _, experts = torch.topk(scores + expert_bias, self.top_k, dim=-1)
        weights = scores.gather(-1, experts)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # The balance loss wants a distribution per token; sigmoid scores are normalised into one.
        probs = scores if self.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, experts, probs


class MoE(nn.Module):
    """Router + grouped experts (+ shared experts): x (bs, seqlen, dim) -> (bs, seqlen, dim)."""

    expert_bias: torch.Tensor  # [E] float32, persistent (checkpointed): the routing choice's bias
    tokens_per_expert: torch.Tensor  # [E] float32, not persistent: pairs routed to each expert since reset_counts

    def __init__(self, args: ModelArgs, shared_experts: nn.Module | None = None) -> None:
        """`shared_experts`: a SwiGLU every token passes through besides its routed experts (None: none; the
        block builds it, width args.moe_shared_hidden_dim, and owns its init)."""
        super().__init__()
        n = args.moe_num_experts
        self.router = TokenChoiceRouter(
            args.dim, n, args.moe_top_k, args.moe_score_func, args.moe_route_norm, args.moe_route_scale
        )
        self.experts = GroupedExperts(args.dim, args.moe_hidden_dim, n, args.moe_grouped_mm)
        self.shared_experts = shared_experts
        # float32 whatever the model's dtype: the bias is updated by small steps, the counts may be large.
        self.register_buffer("expert_bias", torch.zeros(n, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(n, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (bs, seqlen, dim) -> (output (bs, seqlen, dim), this forward's routing statistics [2, E]
        (ROUTER_STATS))."""
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)
        weights, experts, probs = self.router(x, self.expert_bias)
        flat = experts.reshape(-1)  # (tokens * k,): pair j is token j // k's (j % k)-th choice
        counts = torch.zeros(self.experts.num_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))  # bincount without a host sync
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        stats = torch.stack([counts.float() / x.shape[0], probs.mean(dim=0)])
        # Sort the pairs by expert (stable: within an expert, in token order), run each expert on its rows, weigh
        # each row by its routing weight and add it back to its token.
        order = torch.argsort(flat, stable=True)
        token = order // self.router.top_k
        out = self.experts(x[token], counts)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(x).index_add(0, token, out)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(bs, seqlen, dim), stats

    @staticmethod
    def param_inits(init_std: float) -> dict[str, ParamInit]:
        """The router's and routed experts' inits, as the dense FFN's: w1 (and the router) std 0.02, w2 and w3 the
        depth-scaled init_std (the shared experts' are the block's: a dense FFN's)."""
        return {
            "router.gate.weight": trunc(0.02),
            "experts.w1": trunc(0.02),
            "experts.w2": trunc(init_std),
            "experts.w3": trunc(init_std),
        }

    def init_buffers(self) -> None:
        """Zero the expert bias and the counts (a meta-built model holds no values)."""
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def reset_counts(self) -> None:
        with torch.no_grad():
            self.tokens_per_expert.zero_()


def reset_moe_counts(model: nn.Module) -> None:
    """Zero the tokens-per-expert counts of every MoE layer in `model`."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.reset_counts()


def expert_bias_step(counts: torch.Tensor, coeff: float) -> torch.Tensor:
    """The auxiliary-loss-free balancing step of DeepSeek-V3 (as torchtitan applies it): each expert's bias moves
    by `coeff` towards balance, up when it got fewer tokens than the mean, down when more (sign(mean - count)),
    then the step is centred (mean 0) so that the biases do not drift together. `counts` [E]: the tokens routed to
    each expert, summed over all ranks. A uniform scale of the counts (all layers recomputed under activation
    checkpointing count twice) does not change the step."""
    counts = counts.float()
    step = coeff * torch.sign(counts.mean() - counts)
    return step - step.mean()


@torch.no_grad()
def update_expert_bias(moe: MoE, coeff: float, counts: torch.Tensor | None = None) -> None:
    """After the optimizer step: expert_bias += expert_bias_step(counts, coeff), then reset the counts. `counts`:
    the all-reduced tokens_per_expert (default: this rank's)."""
    moe.expert_bias.add_(expert_bias_step(moe.tokens_per_expert if counts is None else counts, coeff))
    moe.reset_counts()


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE FFN of `model`, in module order (through AC and compile wrappers)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def load_balance_loss(router_stats: list[torch.Tensor]) -> torch.Tensor | None:
    """The auxiliary balance loss of one forward's MoE layers (`Transformer.router_stats`), as transformers'
    Qwen3-MoE computes it (load_balancing_loss_func, the Switch Transformer loss): over all L layers together,
    E * sum_e f_e * P_e with f_e the fraction of (token, expert) pairs routed to e and P_e the router probability
    of e, each averaged over tokens and layers. Pooled first, so not the mean of per-layer losses (their sum of
    products differs from this product of sums). None without MoE layers."""
    if not router_stats:
        return None
    f, p = torch.stack(router_stats).mean(dim=0)
    return f.numel() * (f * p).sum()
