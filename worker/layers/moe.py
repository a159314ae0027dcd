"""A sparse Mixture-of-Experts MLP: top-k routing, tokens grouped by expert, one matmul per
active expert (each expert a `GatedMLP`, so its projections run on the layers' kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.linear import Linear
from worker.layers.mlp import GatedMLP


@dataclass(frozen=True)
class MoESpec:
    """What a family's MoE block is: sizes, routing, and an optional shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    act: str = "silu"
    shared_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert, sigmoid-gated


class SparseMoE(nn.Module):
    """x [T, H] -> the routing-weighted sum of its top-k experts' outputs (+ shared expert).

    Routing follows HF: softmax in float32 over the router's logits, top-k, renormalised
    where the family does, weights cast to x's dtype. Tokens are sorted by expert once; each
    active expert multiplies its tokens in one batch and adds them back in expert order, so
    a token's sum has the same order whatever else is in the step (batch invariant where
    the expert matmuls are).
    """

    def __init__(self, hidden_size: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Linear(hidden_size, spec.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, spec.intermediate_size, spec.act) for _ in range(spec.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, spec.shared_intermediate_size, spec.act)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.route(x)
        out = self._experts(x, weights, expert_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _experts(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.view(-1)
        order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.spec.num_experts).tolist()
        rows = x[order // top_k]  # one gather, each expert's tokens contiguous
        ys = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                ys[start : start + count] = self.experts[expert](rows[start : start + count])
                start += count
        ys.mul_(weights.view(-1)[order, None])
        return self._sum_in_expert_order(ys, order, expert_ids)

    @staticmethod
    def _sum_in_expert_order(
        ys: torch.Tensor, order: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Each token's weighted expert outputs summed one by one in ascending expert order,
        as HF's loop of `index_add_` sums them (bf16 `index_add_` runs a slow scatter)."""
        num_tokens, top_k = expert_ids.shape
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel())  # pair -> its row of ys
        slots = expert_ids.argsort(dim=1, stable=True)  # each token's experts, ascending
        pairs = torch.arange(num_tokens)[:, None] * top_k + slots
        per_token = ys[position[pairs]]  # [T, k, H]
        out = per_token[:, 0]
        for slot in range(1, top_k):
            out = out + per_token[:, slot]
        return out
