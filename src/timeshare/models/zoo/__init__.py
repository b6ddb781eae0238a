"""The model zoo: every model built from code, weights generated (seeded) and cached.

Full-size models (parameter counts checked against the papers' architectures):
``resnet152``, ``inception_v3``, ``bert_base``. Small models for fast tests:
``tiny_mlp``, ``tiny_cnn``, ``tiny_bert``, ``tied_lm``.
"""

from timeshare.models.zoo.registry import ZOO, ZooModel, get, names, weights_path

__all__ = ["ZOO", "ZooModel", "get", "names", "weights_path"]
