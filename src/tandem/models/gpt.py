"""A small decoder-only transformer (GPT) as an ``nn.Sequential``: embedding, N blocks, head."""

from __future__ import annotations


import torch
from torch import nn
from torch.nn import functional as F

from tandem.data.info import DataInfo
from tandem.spec.model import GPTOptions


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, max_len: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        embedded: torch.Tensor = self.dropout(self.tokens(tokens) + self.positions(positions))
        return embedded


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only earlier ones.

    The heads are counted from ``qkv``'s output, so the module also runs on a tensor-parallel
    worker's share of them (:mod:`tandem.models.tensor`'s ``heads`` style)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, -1, self.head_dim).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(batch, length, -1))
        return projected


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


def build_gpt(options: GPTOptions, info: DataInfo) -> nn.Sequential:
    """Embedding, ``layers`` blocks, then layer norm and the vocabulary projection."""
    (max_len,) = info.input_shape
    blocks: list[nn.Module] = [Embedding(info.num_classes, max_len, options.dim, options.dropout)]
    blocks += [
        Block(options.dim, options.heads, options.mlp_ratio, options.dropout)
        for _ in range(options.layers)
    ]
    blocks.append(nn.Sequential(nn.LayerNorm(options.dim), nn.Linear(options.dim, info.num_classes)))
    return nn.Sequential(*blocks)
