"""The demo's model and data: a small mixture-of-experts transformer on a synthetic task.

Layout on a world of W ranks, seen as an ``(ep, edp)`` mesh (W = 4: ep = 2, edp = 2):

* dense parameters (embeddings, attention, the dense MLP, the router, the head) are sharded with
  ``fully_shard`` over all W ranks;
* the E experts are split between the ``ep`` groups (group k holds experts
  ``k * E/ep ... (k+1) * E/ep - 1``), and each group's experts are sharded with ``fully_shard``
  over that group's ``edp`` ranks. Expert FQNs carry the global expert id
  (``layers.1.ffn.experts.3.fc1.weight``), so checkpoints reshard to any other ``ep``.

Routing is top-1 and needs no all-to-all: the ranks of one ``ep`` group (same ``edp`` coordinate,
different ``ep`` coordinates) all-gather their tokens, each rank runs its own experts on the
tokens routed to them, and a reduce-scatter sums the partial outputs and hands every rank back
its own tokens. Both collectives are differentiable (their backward passes are each other).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

__all__ = ["ModelConfig", "MoETransformer", "make_rule", "global_batch"]

# torch 2.13 renamed the functional collectives (the old names still work, with a warning)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_all_gather_ad = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)
_reduce_scatter_ad = (
    getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
)


class ModelConfig:
    vocab = 32
    seq = 32
    dim = 64
    heads = 4
    ffn = 128
    experts = 4
    expert_ffn = 96
    aux_loss = 0.01  # Switch-Transformer load-balancing loss weight


# ---------------------------------------------------------------------------------------------
# data: next-token prediction on sequences from a fixed second-order rule


def make_rule(vocab: int, seed: int) -> torch.Tensor:
    """Four random permutations of the vocabulary: ``x[t+1] = rule[x[t-1] % 4, x[t]]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g) for _ in range(4)])


def global_batch(
    step: int, rule: torch.Tensor, batch: int, seq: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (identical on every rank and every world size).

    The next token depends on the current token AND the one before it, so the model has to
    attend to the previous position: a bigram model plateaus at ln 4, attention gets to ~0.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    vocab = rule.shape[1]
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, :2] = torch.randint(vocab, (batch, 2), generator=g)
    for t in range(2, seq + 1):
        x[:, t] = rule[x[:, t - 2] % 4, x[:, t - 1]]
    return x[:, :-1], x[:, 1:]


# ---------------------------------------------------------------------------------------------
# model


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class LocalExperts(nn.Module):
    """The experts this rank's ``ep`` group holds, as children named by their global id.

    A plain ``nn.Module``, not an ``nn.ModuleDict``: torch 2.11's ``fully_shard`` refuses any
    ``ModuleDict`` (torch 2.13 only one without a ``forward``). The FQNs are the same either
    way (``experts.3.fc1.weight``)."""

    def __init__(self, experts: dict[str, nn.Module]):
        super().__init__()
        for key, expert in experts.items():
            self.add_module(key, expert)

    def forward(self, h: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for key, expert in self.named_children():
            sel = (expert_idx == int(key)).nonzero(as_tuple=True)[0]
            # every expert runs, on zero tokens if none were routed to it: its FSDP all-gather
            # and reduce-scatter must happen on every rank of its edp group
            out = out.index_add(0, sel, expert(h[sel]))
        return out


class MoE(nn.Module):
    """Top-1 mixture of experts over an expert-parallel group (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, ep_rank: int, ep_size: int, ep_group, seed: int):
        super().__init__()
        self.n_experts = cfg.experts
        self.ep_group = ep_group  # None when ep_size == 1
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        per = cfg.experts // ep_size
        experts = {}
        for e in range(ep_rank * per, (ep_rank + 1) * per):
            with torch.random.fork_rng(devices=[]):  # same init for expert e on any layout
                torch.manual_seed(seed + 1000 + e)
                experts[str(e)] = MLP(cfg.dim, cfg.expert_ffn)
        self.experts = LocalExperts(experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        h = x.reshape(b * t, c)
        probs = self.router(h).float().softmax(-1)
        gate, idx = probs.max(-1)
        # Switch-Transformer load balancing, per sequence and then averaged, so the global
        # loss does not depend on how the batch is split over ranks
        frac = F.one_hot(idx, self.n_experts).float().view(b, t, -1).mean(1)
        aux = self.n_experts * (frac * probs.view(b, t, -1).mean(1)).sum(-1).mean()
        if self.ep_group is None:
            y = self.experts(h, idx)
        else:
            # One functional collective in flight at a time: on gloo (torch 2.13), a second one
            # issued before the first is waited corrupts the heap (docs/troubleshooting.md).
            h_all = funcol.wait_tensor(_all_gather_ad(h, 0, self.ep_group))
            idx_all = funcol.wait_tensor(_all_gather(idx, 0, self.ep_group))
            y_all = self.experts(h_all, idx_all)
            y = funcol.wait_tensor(_reduce_scatter_ad(y_all, "sum", 0, self.ep_group))
        return (y * gate.unsqueeze(-1).to(y.dtype)).view(b, t, c), aux


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn: nn.Module):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.norm1(x))
        out = self.ffn(self.norm2(x))
        if isinstance(out, tuple):
            y, aux = out
        else:
            y, aux = out, x.new_zeros((), dtype=torch.float32)
        return x + y, aux


class MoETransformer(nn.Module):
    """Layer 0: attention + dense MLP. Layer 1: attention + mixture of experts."""

    def __init__(self, cfg: ModelConfig, ep_rank: int, ep_size: int, ep_group, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.layers = nn.ModuleList(
            [
                Block(cfg, MLP(cfg.dim, cfg.ffn)),
                Block(cfg, MoE(cfg, ep_rank, ep_size, ep_group, seed)),
            ]
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos(pos)
        aux_total = h.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            h, aux = layer(h)
            aux_total = aux_total + aux
        return self.head(self.norm(h)), aux_total

    def expert_modules(self) -> list[LocalExperts]:
        return [m for m in self.modules() if isinstance(m, LocalExperts)]
