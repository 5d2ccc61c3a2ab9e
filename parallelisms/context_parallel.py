"""Context parallelism (CP): every sequence is split over the ranks of a CP group; attention exchanges keys/values.

Each rank of a CP group gets the same batch from the data loader and keeps its part of every sequence
(`ContextParallel.shard`): inputs, labels and the global positions of its tokens, by which RoPE rotates
(`Transformer.forward(tokens, positions)`). Everything but attention is per token, so it runs on the local part
unchanged; attention is replaced in every block by `ContextParallel.attention` (the model's `Attention.core`
hook), which needs
the keys and values of the whole sequence.

The split (`SequenceLayout`): the sequence is cut into chunks of equal length, `cp` chunks (rank i holds chunk i)
or, with torchtitan's head-tail load balancer, `2 cp` chunks with rank i holding chunks i and 2 cp - 1 - i, so that
causal attention, which costs more for later queries, gives every rank the same work.

The attention (`_CPAttention`, one autograd Function): for each pair (query chunk held here, key chunk of any rank)
it runs the device's SDPA kernel that also returns the log-sum-exp of the scores: the whole block when the keys
come before the queries, the causal diagonal block when the chunks are the same, nothing when the keys come after.
The partial outputs of a query chunk are merged by their log-sum-exps (online softmax), exactly as one kernel over
the whole sequence would combine them. Backward calls the kernel's backward for each pair with the merged output
and log-sum-exp, which gives each pair's exact share of the gradients (the flash-attention identity); the key and
value gradients go back to the rank that owns those keys. How keys and values travel:

- `allgather`: one all-gather of every rank's keys and values (again in backward); the key/value gradients of all
  chunks are summed back to their owners with one reduce-scatter.
- `alltoall`: a ring: at step s each rank computes with the keys/values of rank (r - s) mod cp, while the next
  rank's arrive (an all-to-all in which each rank sends only to its successor); backward passes the keys/values
  round again, and with them the accumulating gradient of each rank's keys/values, which ends at its owner.

Both visit the chunks in the same order and run the same kernels, so the two methods give the same forward
output. Only this rank's queries, keys, values, output and log-sum-exp are saved for backward: the other ranks'
keys/values are fetched again, never kept.

Kernels: on CPU `aten._scaled_dot_product_flash_attention_for_cpu` and its backward (what
F.scaled_dot_product_attention runs there); on CUDA the flash kernel (bf16/fp16) or the memory-efficient one
(fp32). torch's own `context_parallel()` covers only the CUDA kernels, so it cannot run where the tests run; kiln
uses this one implementation on both. The CUDA kernel calls ran on one H200 in one process (2026-11-26: a rank holding
both head-tail chunks, against float64 attention); CP over several GPUs has not run.

Document masks (models/attention.py's block_causal flavors) are refused with CP (kiln_base/config/checks.py,
check_parallel_plan). To split them: every CP rank holds the whole batch before sharding, so it can number the
documents of the whole sequence (models.attention.document_ids); each pair (query chunk, key chunk) would then run
with its block of the mask (positions and document ids of both chunks: the CPU kernel takes a boolean attn_mask
and returns the log-sum-exp, and so does its backward), a pair whose keys all lie in other documents would be
skipped like a future pair, and a row with no key in a block merges as log-sum-exp -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kiln_base.config import Parallelism, SequenceSplit

if TYPE_CHECKING:
    from parallelisms.parallel_dims import ParallelDims

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class SequenceLayout(SequenceSplit):
    """How one sequence is split over `cp` ranks (kiln_base.config.SequenceSplit: `n_chunks` equal chunks, of which
    rank r holds `chunks(r)`, in that order), applied to tensors: its local tokens are those chunks concatenated."""

    def positions(self, rank: int, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions (int64) of rank `rank`'s tokens, in its local order."""
        size = seq_len // self.n_chunks
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks(rank)])

    def shard(self, t: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank `rank`'s part of `t` along the sequence dimension `dim` (a copy when it is two chunks)."""
        pieces = t.chunk(self.n_chunks, dim=dim)
        held = [pieces[c] for c in self.chunks(rank)]
        return held[0] if len(held) == 1 else torch.cat(held, dim=dim)


# ----------------------------------------------------------------------------- kernels: SDPA with log-sum-exp


def kernel_for(q: torch.Tensor) -> str:
    """Which SDPA kernel runs a block: `cpu` (the CPU flash kernel), `cuda_flash` (bf16/fp16) or `cuda_efficient`."""
    if q.device.type == "cuda":
        return "cuda_flash" if q.dtype in (torch.bfloat16, torch.float16) else "cuda_efficient"
    return "cpu"


def _padded32(n: int) -> int:
    return (n + 31) // 32 * 32


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for q (bs, heads, sq, d), k/v (bs, heads, sk, d); lse (bs, heads, sq) float32. Causal is the
    top-left-aligned mask, which for sq == sk (a diagonal block) is the causal one."""
    if kernel == "cuda_flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out, lse
    if kernel == "cuda_efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
        return out, lse[..., : q.shape[2]]  # the kernel pads lse's rows to a multiple of 32
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the *merged* output and log-sum-exp of its query rows: the block's exact share
    of the gradients (the kernels recompute the probabilities as exp(scores - lse)). Without dropout the CUDA
    kernels' random-state arguments are unused: empty tensors stand in for them. Checked on an H200 (torch's CUDA
    build): tests/parallelisms/test_context_parallel.py::test_chunked_attention_on_cuda_equals_attention_in_float64."""
    if kernel == "cuda_flash":  # no cumulative sequence lengths (not varlen): None, not empty tensors
        none = torch.empty(0, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, none, none
        )
    if kernel == "cuda_efficient":
        none = torch.empty(0, device=q.device)
        lse = torch.nn.functional.pad(lse, (0, _padded32(lse.shape[-1]) - lse.shape[-1]))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(  # no bias: None, not an empty tensor
            dout, q, k, v, None, out, lse, none, none, 0.0, [True, True, True, False], causal
        )
        return dq, dk, dv
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor) -> tuple[Any, Any]:
    """Combine two partial attentions of the same query rows (float32): softmax over the union of their keys."""
    out, lse = out.float(), lse.float()
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    new_out = acc_out * torch.exp(acc_lse - new_lse).unsqueeze(-1) + out * torch.exp(lse - new_lse).unsqueeze(-1)
    return new_out, new_lse


# ----------------------------------------------------------------------------- collectives (functional ops)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(t)


def _all_gather(t: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """(size * t.shape[0], ...) in rank order; not waited."""
    return c10d.all_gather_into_tensor(t.contiguous(), size, group)


def _reduce_scatter_sum(t: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return c10d.reduce_scatter_tensor(t.contiguous(), "sum", size, group)


def _to_next_rank(t: torch.Tensor, group: str, rank: int, size: int) -> torch.Tensor:
    """Send `t` to rank + 1 and receive the same-shaped tensor of rank - 1 (mod size); not waited."""
    n = t.numel()
    send = [0] * size
    send[(rank + 1) % size] = n
    recv = [0] * size
    recv[(rank - 1) % size] = n
    return c10d.all_to_all_single(t.contiguous().view(-1), recv, send, group).view(t.shape)


# ----------------------------------------------------------------------------- the attention


@dataclass(frozen=True)
class ContextParallel:
    """This rank's side of context parallelism: which part of every sequence it keeps (`shard_batch`) and the
    attention over the whole sequence (`attention`, the model's AttentionCore; see the module docstring)."""

    layout: SequenceLayout
    rank: int  # in the CP group
    group: str  # the CP group's name (functional collectives take it; compiled graphs keep it as a constant)
    rotate_method: str  # allgather | alltoall

    def shard_batch(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's part of a batch every CP rank holds whole: (inputs, labels, positions, loss normalizer).

        The normalizer is the batch's label count over cp: each rank's loss is the sum of its tokens' losses
        divided by it, so the mean of the CP ranks' losses is the mean over every token of the sequences (even
        if the ranks held different numbers of tokens), and the gradients FSDP averages over the CP ranks are
        those of that mean."""
        positions = self.layout.positions(self.rank, inputs.shape[1], inputs.device)
        normalizer = torch.tensor(labels.numel() / self.layout.cp, device=labels.device)
        return self.layout.shard(inputs, self.rank), self.layout.shard(labels, self.rank), positions, normalizer

    def attention(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """The AttentionCore: q, k, v (bs, local seq, heads, d) of this rank's tokens -> (bs, local seq, heads, d),
        causal over the whole sequence. Document masks are refused with CP before the build (check_parallel_plan)."""
        assert mask is None, "context parallelism runs causal attention only (kiln_base.config.check_parallel_plan)"
        out = _CPAttention.apply(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), self)
        return out.transpose(1, 2)  # the output was built in xq's layout: this is contiguous, no copy follows

    def owner(self, step: int) -> int:
        """The rank whose keys/values step `step` uses: this rank first, then round the ring backwards."""
        return (self.rank - step) % self.layout.cp

    def pairs(self, owner: int) -> list[tuple[int, int, bool]]:
        """(local query chunk, owner's key chunk, causal) for every block that has unmasked scores: keys before the
        queries (whole block) or the same chunk (causal diagonal)."""
        mine, theirs = self.layout.chunks(self.rank), self.layout.chunks(owner)
        return [(i, j, qc == kc) for i, qc in enumerate(mine) for j, kc in enumerate(theirs) if kc <= qc]


def build_context_parallel(dims: ParallelDims, p: Parallelism) -> ContextParallel | None:
    """This rank's ContextParallel from the mesh's `cp` dimension; None when context parallelism is off. The
    build makes it once (trainer/build.py build_model): the blocks' attention and the Trainer's batch sharding."""
    if not dims.cp_enabled:
        return None
    mesh = dims.cp_mesh
    layout = SequenceLayout.of(p)
    return ContextParallel(layout, mesh.get_local_rank(), mesh.get_group().group_name, p.context_parallel_rotate_method)


def _repeat_heads(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(bs, kv_heads, s, d) -> (bs, kv_heads * n_rep, s, d): each kv head serves n_rep consecutive query heads."""
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def _sum_heads(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of _repeat_heads: (bs, kv_heads * n_rep, s, d) -> (bs, kv_heads, s, d)."""
    if n_rep == 1:
        return t
    bs, heads, s, d = t.shape
    return t.view(bs, heads // n_rep, n_rep, s, d).sum(2)


class _KeyValues:
    """The CP group's keys/values, one rank's (stacked k and v, (2, bs, kv_heads, s_local, d)) per step in
    ContextParallel.owner's order, and the way their gradients go back to their owners."""

    def __init__(self, cp: ContextParallel, kv: torch.Tensor, grads: bool) -> None:
        self.cp, self.size, self.kv = cp, cp.layout.cp, kv
        self.gathered: torch.Tensor | None = None
        self.incoming: torch.Tensor | None = None  # alltoall: the next rank's k/v (or k/v gradient) on its way
        self.current = kv
        self.grad_all: torch.Tensor | None = None  # allgather: every owner's k/v gradient, reduce-scattered at the end
        self.grad_incoming: torch.Tensor | None = None
        if cp.rotate_method == "allgather":
            self.gathered = _wait(_all_gather(kv, cp.group, self.size)).view(self.size, *kv.shape)
            if grads:
                self.grad_all = torch.zeros((self.size, *kv.shape), dtype=torch.float32, device=kv.device)

    def fetch(self, step: int) -> torch.Tensor:
        """The k/v of owner(step); on the ring, starts sending them on to the next rank (overlapping this step)."""
        if self.gathered is not None:
            return self.gathered[self.cp.owner(step)]
        if step > 0:
            assert self.incoming is not None
            self.current = _wait(self.incoming)
        self.incoming = (
            _to_next_rank(self.current, self.cp.group, self.cp.rank, self.size) if step < self.size - 1 else None
        )
        return self.current

    def grad(self, step: int) -> torch.Tensor:
        """Where this step's k/v gradient accumulates (float32): on the ring, what the ranks before this one on it
        accumulated for the same owner."""
        if self.grad_all is not None:
            return self.grad_all[self.cp.owner(step)]
        if step == 0:
            return torch.zeros(self.kv.shape, dtype=torch.float32, device=self.kv.device)
        assert self.grad_incoming is not None
        return _wait(self.grad_incoming)

    def pass_grad(self, grad: torch.Tensor) -> None:
        """Ring: send the gradient on; after the last step it reaches the owner."""
        if self.grad_all is None:
            self.grad_incoming = _to_next_rank(grad, self.cp.group, self.cp.rank, self.size)

    def own_grad(self) -> torch.Tensor:
        """This rank's k/v gradient, summed over every rank's queries."""
        if self.grad_all is not None:
            flat = self.grad_all.view(self.size * self.kv.shape[0], *self.kv.shape[1:])
            return _wait(_reduce_scatter_sum(flat, self.cp.group, self.size))
        assert self.grad_incoming is not None
        return _wait(self.grad_incoming)


class _CPAttention(torch.autograd.Function):
    """out = causal attention of local q over the CP group's k/v; saves only the local q, k, v, out and lse."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        n_rep, kernel, n_local = q.shape[1] // k.shape[1], kernel_for(q), len(cp.layout.chunks(cp.rank))
        q_chunks = q.chunk(n_local, dim=2)
        kvs = _KeyValues(cp, torch.stack([k, v]), grads=False)
        acc: list[Any] = [None] * n_local
        for step in range(cp.layout.cp):
            kv = kvs.fetch(step)
            k_chunks, v_chunks = kv[0].chunk(n_local, dim=2), kv[1].chunk(n_local, dim=2)
            for i, j, causal in cp.pairs(cp.owner(step)):
                keys, values = _repeat_heads(k_chunks[j], n_rep), _repeat_heads(v_chunks[j], n_rep)
                acc[i] = _merge(acc[i], *attention_forward(q_chunks[i], keys, values, causal, kernel))
        out = torch.empty_like(q)  # q's layout: the caller's transpose back is then contiguous, no copy
        for i, chunk in enumerate(out.chunk(n_local, dim=2)):
            chunk.copy_(acc[i][0])
        lse = torch.cat([a[1] for a in acc], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        n_rep, kernel, n_local = q.shape[1] // k.shape[1], kernel_for(q), len(cp.layout.chunks(cp.rank))
        q_chunks, out_chunks, dout_chunks = (t.chunk(n_local, dim=2) for t in (q, out, dout))
        lse_chunks = [c.contiguous() for c in lse.chunk(n_local, dim=2)]
        dq = torch.zeros_like(q, dtype=torch.float32)
        dq_chunks = dq.chunk(n_local, dim=2)
        kvs = _KeyValues(cp, torch.stack([k, v]), grads=True)
        for step in range(cp.layout.cp):
            kv, dkv = kvs.fetch(step), kvs.grad(step)
            k_chunks, v_chunks = kv[0].chunk(n_local, dim=2), kv[1].chunk(n_local, dim=2)
            dk_chunks, dv_chunks = dkv[0].chunk(n_local, dim=2), dkv[1].chunk(n_local, dim=2)
            for i, j, causal in cp.pairs(cp.owner(step)):
                keys, values = _repeat_heads(k_chunks[j], n_rep), _repeat_heads(v_chunks[j], n_rep)
                dq_ij, dk_ij, dv_ij = attention_backward(
                    dout_chunks[i], q_chunks[i], keys, values, out_chunks[i], lse_chunks[i], causal, kernel
                )
                dq_chunks[i].add_(dq_ij)
                dk_chunks[j].add_(_sum_heads(dk_ij, n_rep))
                dv_chunks[j].add_(_sum_heads(dv_ij, n_rep))
            kvs.pass_grad(dkv)
        dkv = kvs.own_grad()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
