"""Modules that exercise the awkward ways real models hold and use weights."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


class ParentUsesChildWeight(nn.Module):
    """The parent reads a child's weight directly and never calls the child."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        return F.linear(torch.relu(self.inner(x)), self.proj.weight) + self.proj.bias


class SharedSubmodule(nn.Module):
    """One submodule registered under two names, called from both."""

    def __init__(self):
        super().__init__()
        lin = nn.Linear(8, 8)
        self.a = lin
        self.b = lin
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return Pair(self.b(self.c(self.a(x))), self.a(x).sum())


class OptionalHead(nn.Module):
    """A head only some calls use: its tensors are not used by the traced forward."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)
        self.register_buffer("offset", torch.linspace(-1, 1, 8), persistent=False)

    def forward(self, x, *, use_head: bool = False):
        h = self.norm(self.body(x) + self.offset)
        if use_head:
            return Out(self.head(h), (h,))
        return Out(h, ())


class OutOfOrder(nn.Module):
    """Modules called in the reverse of their registration order, one of them twice."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.first = nn.Conv1d(1, 1, 3, padding=1)
        self.bn = nn.BatchNorm1d(1)

    def forward(self, x):
        y = self.bn(self.first(x.unsqueeze(1))).squeeze(1)
        return {"y": self.last(self.middle(self.middle(y))), "n": 3}


def build(cls):
    torch.manual_seed(0)
    m = cls()
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm1d):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
    return m


def parent_uses_child_weight():
    return build(ParentUsesChildWeight)


def shared_submodule():
    return build(SharedSubmodule)


def optional_head():
    return build(OptionalHead)


def out_of_order():
    return build(OutOfOrder)


CASES = {
    "parent_uses_child_weight": parent_uses_child_weight,
    "shared_submodule": shared_submodule,
    "optional_head": optional_head,
    "out_of_order": out_of_order,
}


class Slow(nn.Module):
    """Many layers, each sleeping: a forward long enough to kill a worker during it."""

    def __init__(self, layers: int = 20, delay_s: float = 0.01):
        super().__init__()
        self.delay_s = delay_s
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(layers))

    def forward(self, x, *, delay_s: float | None = None, fail: bool = False):
        import time

        for layer in self.layers:
            time.sleep(self.delay_s if delay_s is None else delay_s)
            x = torch.tanh(layer(x))
        if fail:
            raise ValueError("the model itself failed")
        return x


def slow():
    return build(Slow)


class Held(nn.Module):
    """Many small layers (a layer-by-layer load has many groups); given ``begun`` (a
    path), the forward creates that file and then holds until its worker is killed. In a
    pipelined load the forward starts once every group is queued, so the file says the
    load is under way and cannot answer before the kill."""

    HOLD_S = 60.0  # a bound all the same: the call's deadline kills a worker held this long

    def __init__(self, layers: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(layers))

    def forward(self, x, *, begun: str = ""):
        import time
        from pathlib import Path

        if begun:
            Path(begun).touch()
            time.sleep(self.HOLD_S)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def held():
    return build(Held)


# --- training jobs (importable, so worker processes can rebuild them) -------------------
def train_net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))


def train_batches(n=150):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def endless_batches():
    batch = train_batches(1)[0]
    while True:
        yield batch


def train_step(model, optimizer, batch):
    import time

    time.sleep(0.002)  # a step that takes a while, so inference really preempts it
    x, y = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def exploding_step(model, optimizer, batch):
    raise RuntimeError("step exploded")


def hanging_step(model, optimizer, batch):
    import time

    time.sleep(3600)


class Sleepy(nn.Module):
    """A linear layer that first sleeps ``x[0, 0] - 10`` seconds when that is positive:
    random inputs never do, so warm-up is quick; a test that needs a request in flight
    sends 11.0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        import time

        delay = float(x[0, 0]) - 10.0
        if delay > 0:
            time.sleep(min(delay, 5.0))
        return self.fc(x)


def sleepy_linear() -> Sleepy:
    torch.manual_seed(0)
    return Sleepy()


class Picky(nn.Module):
    """A linear layer that raises on a row whose first value is exactly 7: one bad
    request among good ones in a batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if bool((x[:, 0] == 7).any()):
            raise ValueError("a row starts with 7")
        return self.fc(x)


def picky_linear() -> Picky:
    # Weights from a generator of its own: an in-process training job elsewhere in the
    # test process swaps the global random state around its steps (a documented limit).
    g = torch.Generator().manual_seed(0)
    p = Picky()
    with torch.no_grad():
        p.fc.weight.copy_(torch.randn(4, 4, generator=g))
        p.fc.bias.copy_(torch.randn(4, generator=g))
    return p


class FlagsProbe(nn.Module):
    """Returns the backend numerics flags of the process that runs it, as numbers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        from timeshare.device import BackendFlags

        f = BackendFlags.capture()
        precisions = {"none": 0, "ieee": 1, "tf32": 2, "bf16": 3, "highest": 4, "high": 5, "medium": 6}
        values = [f.cudnn_benchmark, f.cudnn_deterministic, f.matmul_allow_fp16_reduced, f.matmul_allow_bf16_reduced,
                  f.deterministic_algorithms, *(precisions[v] for _, v in f.precisions), *(f.legacy or ())[:2]]
        return self.lin(x).sum() * 0 + torch.tensor([float(v) for v in values])


def flags_probe():
    return build(FlagsProbe)


class DeterminismProbe(nn.Module):
    """Returns whether the process that runs it computes with deterministic kernels (NOTE
    [Deterministic kernels]): deterministic algorithms, cuDNN deterministic, cuDNN
    benchmark, and CUBLAS_WORKSPACE_CONFIG at a value PyTorch accepts, as 1.0 or 0.0."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        import os

        flags = [torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                 torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")]
        return self.lin(x).sum() * 0 + torch.tensor([float(f) for f in flags])


def determinism_probe():
    return build(DeterminismProbe)


class EnvProbe(nn.Module):
    """Returns the length of $TIMESHARE_TEST_MARK in the process that runs it (0: unset)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        import os

        return self.lin(x).sum() * 0 + float(len(os.environ.get("TIMESHARE_TEST_MARK", "")))


def env_probe():
    return build(EnvProbe)


class RowSum(nn.Module):
    """Each row's sum and its first and last values: takes inputs of any width (the large
    JSON bodies of the hostile-client tests)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x.sum(dim=1, keepdim=True) * self.scale, x[:, :4], x[:, -4:]


def row_sum():
    return build(RowSum)


def wait_until(condition, timeout_s: float = 60.0, what: str = "the condition") -> None:
    """Poll ``condition()`` until it holds; fail the test after ``timeout_s`` seconds."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout_s:g} s"
        time.sleep(0.005)


def offload_batches():
    """Endless regression batches for offload tests (a fixed seed: every run sees the same)."""
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def mse_step(model, optimizer, batch):
    x, y = batch
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


class TierNet(nn.Module):
    """A small net with persistent buffers (batch norm) and a non-persistent one that a
    weights file does not carry (the host tier keeps the module's own value)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.bn = nn.BatchNorm1d(256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 8)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x)))))) * self.scale


def tier_net() -> TierNet:
    return TierNet()


def seeded_tier_net(seed: int) -> TierNet:
    """``tier_net`` with weights and batch-norm statistics drawn from ``seed`` (a generator
    of its own: running jobs swap the global random state)."""
    net = TierNet().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(net.parameters()) + [net.bn.running_mean, net.bn.running_var]:
            t.copy_(torch.rand(t.shape, generator=g) * 0.2 + (0.5 if t is net.bn.running_var else -0.1))
    return net


class EmbedNet(nn.Module):
    """A large embedding table (20 MB) in front of a small net: the case for direct host
    access (NOTE [Direct host access]), a few looked-up rows of a table worth a long copy."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(80_000, 64)
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 8)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.embed(ids).mean(dim=1))))


def embed_net() -> EmbedNet:
    return EmbedNet()


def seeded_embed_net(seed: int) -> EmbedNet:
    net = EmbedNet().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return net


def embed_variant(variant: int) -> EmbedNet:
    """``seeded_embed_net(0)``'s embedding table under a small net of its own (seeded from
    ``variant``): variants that share only the table (NOTE [Shared tensors])."""
    net = seeded_embed_net(0)
    g = torch.Generator().manual_seed(1000 + variant)
    with torch.no_grad():
        for p in [*net.fc1.parameters(), *net.fc2.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return net


class EmbedRowsNet(EmbedNet):
    """An ``EmbedNet`` that also returns its table's first rows: a view of its weight."""

    def forward(self, ids):
        return super().forward(ids), self.embed.weight[:4]


def embed_rows_variant(variant: int) -> EmbedRowsNet:
    net = EmbedRowsNet().eval()
    net.load_state_dict(embed_variant(variant).state_dict())
    return net


class VariantNet(nn.Module):
    """A base of four 256 KiB layers and a head: fine-tuned variants share the base
    (NOTE [Shared tensors])."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 128)
        self.base = nn.ModuleList(nn.Linear(256 if i else 128, 256) for i in range(4))
        self.norm = nn.LayerNorm(256)
        self.head = nn.Linear(256, 256)
        self.out = nn.Linear(256, 4)

    def forward(self, ids):
        x = self.embed(ids).mean(dim=1)
        for layer in self.base:
            x = torch.relu(layer(x))
        return self.out(torch.tanh(self.head(self.norm(x))))


def variant_net(variant: int, base_seed: int = 0, tuned: tuple[str, ...] = ("head", "out")) -> VariantNet:
    """The base drawn from ``base_seed``; the modules named in ``tuned`` from ``variant``
    (generators of their own: running jobs swap the global random state)."""
    net = VariantNet().eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(base_seed)
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        g = torch.Generator().manual_seed(1000 + variant)
        for name in tuned:
            for p in getattr(net, name).parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return net


def wide_relu() -> nn.Module:
    """A 512-wide linear layer and a ReLU (1 MiB of float32 weights) drawn from a seed (a
    generator of its own): a model that takes a block of the arena, in-process or in a
    worker process."""
    net = nn.Sequential(nn.Linear(512, 512), nn.ReLU())
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return net
