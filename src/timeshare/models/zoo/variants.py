"""Fine-tuned variants of BERT-base, built from code with seeded weights: one base (the
encoder and embeddings, from ``base_seed``) and, per variant, its own pooler and
classifier head and, optionally, its own last ``tuned_layers`` encoder layers: the case
for tensors held once across models (NOTE [Shared tensors] in ``runtime/sharing.py``)."""

from __future__ import annotations

import torch
from torch import nn

from timeshare.models.zoo.bert import Bert, bert_base, tiny_bert

SIZES = {"base": (bert_base, "bert_base"), "tiny": (tiny_bert, "tiny_bert")}  # the encoder, and its zoo inputs


class BertClassifier(nn.Module):
    """A BERT encoder with a classification head on its pooled output."""

    def __init__(self, bert: Bert, labels: int = 2):
        super().__init__()
        self.bert = bert
        self.classifier = nn.Linear(bert.pooler.out_features, labels)

    def forward(self, input_ids, attention_mask=None):
        return self.classifier(self.bert(input_ids, attention_mask).pooler_output)


def tuned_modules(net: BertClassifier, tuned_layers: int) -> list[nn.Module]:
    """The modules a variant has of its own: the head and the last ``tuned_layers`` layers."""
    layers = list(net.bert.layers)
    return [net.bert.pooler, net.classifier] + (layers[len(layers) - tuned_layers:] if tuned_layers else [])


def bert_variant(variant: int, tuned_layers: int = 0, base_seed: int = 0, size: str = "base") -> BertClassifier:
    """Variant ``variant`` of BERT-base (``size`` "tiny": the zoo's 2-layer BERT): every
    weight drawn from ``base_seed`` (normal, std 0.02; layer norms at their initial
    values), then the tuned modules' weights drawn again from the variant's own seed.
    Generators of their own: the global random state is not used."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    net = BertClassifier(SIZES[size][0]()).eval()
    if not 0 <= tuned_layers <= len(net.bert.layers):
        raise ValueError(f"tuned_layers must be in [0, {len(net.bert.layers)}], got {tuned_layers}")

    def draw(modules, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for module in modules:
            for name, p in module.named_parameters():
                if isinstance(dict(module.named_modules()).get(name.rpartition(".")[0]), nn.LayerNorm):
                    continue
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)

    with torch.no_grad():
        draw([net], base_seed)
        draw(tuned_modules(net, tuned_layers), 10_000 + variant)
    return net
