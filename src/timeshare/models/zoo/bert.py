"""BERT-base (Devlin et al. 2019) encoder with pooler: 109,482,240 parameters.

The forward takes keyword arguments and returns a dataclass, like the encoders
users bring, so the zoo exercises those paths too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class BertOutput:
    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def _split(self, x):
        b, s, h = x.shape
        return x.view(b, s, self.heads, h // self.heads).transpose(1, 2)

    def forward(self, x, mask_bias):
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask_bias
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        return self.norm(x + self.out(ctx))


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.intermediate = nn.Linear(hidden, ffn)
        self.output = nn.Linear(ffn, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x, mask_bias):
        x = self.attention(x, mask_bias)
        return self.norm(x + self.output(F.gelu(self.intermediate(x))))


class Bert(nn.Module):
    def __init__(
        self,
        vocab: int = 30522,
        hidden: int = 768,
        layers: int = 12,
        heads: int = 12,
        ffn: int = 3072,
        max_positions: int = 512,
        type_vocab: int = 2,
    ):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> BertOutput:
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embed_norm(x + self.token_type_embeddings(token_type_ids))
        if attention_mask is None:
            mask_bias = torch.zeros((), dtype=x.dtype, device=x.device)
        else:
            mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask_bias)
        return BertOutput(x, torch.tanh(self.pooler(x[:, 0])))


def bert_base() -> Bert:
    return Bert()


def tiny_bert() -> Bert:
    return Bert(vocab=1000, hidden=64, layers=2, heads=4, ffn=128, max_positions=64)
