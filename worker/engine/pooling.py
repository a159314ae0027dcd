"""Token states of a packed batch -> one vector per sequence, as sentence-transformers pools.

Sums run in float32 whatever the model dtype (sentence-transformers accumulates bf16 means
in float32 too); the result is float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, seq_lens: list[int], mode: str) -> torch.Tensor:
    """hidden [T, H] of sequences of `seq_lens` back to back -> [num_seqs, H] float32."""
    lens = torch.tensor(seq_lens, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if mode == "cls":
        return hidden[ends - lens].float()
    if mode == "lasttoken":
        return hidden[ends - 1].float()
    owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
    states = hidden.float()
    if mode == "max":
        out = states.new_full((len(seq_lens), states.shape[1]), float("-inf"))
        return out.scatter_reduce(0, owner[:, None].expand_as(states), states, reduce="amax")
    sums = states.new_zeros(len(seq_lens), states.shape[1]).index_add_(0, owner, states)
    counts = lens.to(torch.float32)[:, None]
    if mode == "mean":
        return sums / counts
    if mode == "mean_sqrt_len_tokens":
        return sums / counts.sqrt()
    raise ValueError(f"pooling mode {mode!r} not supported")


def finish_vector(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation to the first `dimensions`, then L2 normalisation (vLLM's order:
    a truncated vector of a normalising model is a unit vector again)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    return F.normalize(vector, p=2, dim=-1) if normalize else vector
