"""A small decoder-only transformer (GPT) and deterministic synthetic data, for the
DeepSpeed trainer, the demo and the tests. Built as a list of layers so that the
same model runs whole or as a DeepSpeed PipelineModule."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1
    # A BatchNorm before the head: running statistics that each DP replica updates from its
    # own data, buffers DeepSpeed does not keep in step across replicas.
    batch_norm: bool = False


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.positions = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tokens(idx) + self.positions(pos))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(), nn.Linear(4 * cfg.hidden, cfg.hidden))
        self.drop = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.batch_norm = nn.BatchNorm1d(cfg.hidden) if cfg.batch_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_norm is not None:
            x = self.batch_norm(x.transpose(1, 2)).transpose(1, 2)
        return self.out(self.ln(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layers(cfg: GPTConfig) -> list[nn.Module]:
    torch.manual_seed(1234)  # the same initial weights on every rank
    return [Embedding(cfg), *[Block(cfg) for _ in range(cfg.layers)], Head(cfg)]


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(*layers(cfg))

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.layers(idx), labels)


def batch(cfg: GPTConfig, step: int, replica: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences that follow a fixed rule (so there is something to learn),
    depending only on (step, data-parallel replica)."""
    g = torch.Generator().manual_seed(step * 10_007 + replica)
    start = torch.randint(0, cfg.vocab_size, (micro_batch, 1), generator=g)
    seq = (start + 7 * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    noise = torch.randint(0, cfg.vocab_size, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
