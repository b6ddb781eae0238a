"""Small models for fast tests, each covering a way real modules are written."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class TinyCNN(nn.Module):
    """Convolutions with BatchNorm running statistics (buffers) and a residual."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)) + y)
        return self.head(y.mean((2, 3)))


class TiedLM(nn.Module):
    """Tied input and output embeddings, a block applied twice, the output head used
    before an earlier-registered module, and a dict output."""

    def __init__(self, vocab: int = 100, d: int = 32):
        super().__init__()
        self.late = nn.Linear(d, d)  # registered first, called last
        self.embed = nn.Embedding(vocab, d)
        self.block = nn.Linear(d, d)
        self.decoder = nn.Linear(d, vocab, bias=False)
        self.decoder.weight = self.embed.weight  # one tensor, two names
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids, *, temperature: float = 1.0):
        h = self.embed(ids)
        h = torch.tanh(self.block(torch.tanh(self.block(h))))  # called twice
        logits = self.decoder(h) / temperature
        return {"logits": logits * self.scale, "hidden": (self.late(h), h.mean())}


def tiny_mlp() -> TinyMLP:
    return TinyMLP()


def tiny_cnn() -> TinyCNN:
    return TinyCNN()


def tied_lm() -> TiedLM:
    return TiedLM()
