"""Inception-v3 (Szegedy et al. 2016), the torchvision layout with the auxiliary
head: 27,161,264 parameters (23,834,568 without it). The auxiliary head only runs
in training mode, so an inference never touches its tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)


class BlockA(nn.Module):
    def __init__(self, cin: int, pool: int):
        super().__init__()
        self.b1 = ConvBN(cin, 64, 1)
        self.b5 = nn.Sequential(ConvBN(cin, 48, 1), ConvBN(48, 64, 5, padding=2))
        self.b3 = nn.Sequential(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, padding=1))
        self.bp = ConvBN(cin, pool, 1)

    def forward(self, x):
        p = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), p], 1)


class BlockB(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.b3 = ConvBN(cin, 384, 3, stride=2)
        self.b3d = nn.Sequential(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, stride=2))

    def forward(self, x):
        return torch.cat([self.b3(x), self.b3d(x), F.max_pool2d(x, 3, stride=2)], 1)


class BlockC(nn.Module):
    def __init__(self, cin: int, c7: int):
        super().__init__()
        self.b1 = ConvBN(cin, 192, 1)
        self.b7 = nn.Sequential(
            ConvBN(cin, c7, 1), ConvBN(c7, c7, (1, 7), padding=(0, 3)), ConvBN(c7, 192, (7, 1), padding=(3, 0))
        )
        self.b7d = nn.Sequential(
            ConvBN(cin, c7, 1),
            ConvBN(c7, c7, (7, 1), padding=(3, 0)),
            ConvBN(c7, c7, (1, 7), padding=(0, 3)),
            ConvBN(c7, c7, (7, 1), padding=(3, 0)),
            ConvBN(c7, 192, (1, 7), padding=(0, 3)),
        )
        self.bp = ConvBN(cin, 192, 1)

    def forward(self, x):
        p = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b7(x), self.b7d(x), p], 1)


class BlockD(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.b3 = nn.Sequential(ConvBN(cin, 192, 1), ConvBN(192, 320, 3, stride=2))
        self.b7 = nn.Sequential(
            ConvBN(cin, 192, 1),
            ConvBN(192, 192, (1, 7), padding=(0, 3)),
            ConvBN(192, 192, (7, 1), padding=(3, 0)),
            ConvBN(192, 192, 3, stride=2),
        )

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, stride=2)], 1)


class BlockE(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.b1 = ConvBN(cin, 320, 1)
        self.b3_stem = ConvBN(cin, 384, 1)
        self.b3_a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.b3_b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.b3d_stem = nn.Sequential(ConvBN(cin, 448, 1), ConvBN(448, 384, 3, padding=1))
        self.b3d_a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.b3d_b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.bp = ConvBN(cin, 192, 1)

    def forward(self, x):
        s = self.b3_stem(x)
        d = self.b3d_stem(x)
        p = self.bp(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([self.b1(x), self.b3_a(s), self.b3_b(s), self.b3d_a(d), self.b3d_b(d), p], 1)


class AuxHead(nn.Module):
    def __init__(self, cin: int, num_classes: int):
        super().__init__()
        self.conv0 = ConvBN(cin, 128, 1)
        self.conv1 = ConvBN(128, 768, 5)
        self.fc = nn.Linear(768, num_classes)

    def forward(self, x):
        x = self.conv1(self.conv0(F.avg_pool2d(x, 5, stride=3)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class InceptionV3(nn.Module):
    """Returns logits; in training mode ``(logits, aux_logits)``."""

    def __init__(self, num_classes: int = 1000, aux_logits: bool = True):
        super().__init__()
        self.stem = nn.Sequential(
            ConvBN(3, 32, 3, stride=2),
            ConvBN(32, 32, 3),
            ConvBN(32, 64, 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(64, 80, 1),
            ConvBN(80, 192, 3),
            nn.MaxPool2d(3, stride=2),
        )
        self.mixed5 = nn.Sequential(BlockA(192, 32), BlockA(256, 64), BlockA(288, 64))
        self.mixed6 = nn.Sequential(BlockB(288), BlockC(768, 128), BlockC(768, 160), BlockC(768, 160), BlockC(768, 192))
        self.aux = AuxHead(768, num_classes) if aux_logits else None
        self.mixed7 = nn.Sequential(BlockD(768), BlockE(1280), BlockE(2048))
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):
        x = self.mixed6(self.mixed5(self.stem(x)))
        aux = self.aux(x) if self.aux is not None and self.training else None
        x = self.mixed7(x)
        logits = self.fc(self.dropout(F.adaptive_avg_pool2d(x, 1).flatten(1)))
        return (logits, aux) if aux is not None else logits


def inception_v3(num_classes: int = 1000, aux_logits: bool = True) -> InceptionV3:
    return InceptionV3(num_classes, aux_logits)
