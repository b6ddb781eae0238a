"""An eager decode step's forward without ``transformers``' per-module machinery, for the
models whose layers it knows. Tensors only; runs where the model's weights are, inside a
step of ``runner.py``.

# NOTE [Lean decode steps]
A decode step computes one position a row, and on the CPU a small model's step is as much
Python as arithmetic: ``transformers``' forward calls some fifteen modules a layer, each
through ``nn.Module.__call__`` and its hooks, under decorators that merge defaults,
capture outputs and rename deprecated arguments. For the Llama family (Llama, Mistral,
Qwen2) the lean step runs the same computation with the model's own pieces, called
directly: the embedding's, the norms' and the activation's forwards, the rotary embedding
module, the modeling file's own ``apply_rotary_pos_emb``, the attention function
``transformers`` would choose (``ALL_ATTENTION_FUNCTIONS``, with the arguments its
attention passes), and ``F.linear`` on each projection's own weight and bias: the same
kernels on the same tensors in the same order, about 5% faster for a 64M model on two
cores. Being the same is checked, not assumed: a runner's first eager step runs both,
and uses the lean step from then on only if its logits and its new keys and values equal
``transformers``' bit for bit (else it warns and keeps ``transformers``' forward). Only
eager steps on the CPU use it: on CUDA a captured graph replays kernels, where Python
costs nothing, a compiled step is traced from ``transformers``' forward, the eager steps
between a relayout and the next capture are few, and the comparison would wait for the
device. Any other architecture decodes through ``transformers``' forward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The families whose decoder layers are Llama's, and what each one's attention passes to
# the attention function beside Llama's arguments.
FAMILIES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "LlamaForCausalLM": lambda attn: {},
    "MistralForCausalLM": lambda attn: {"sliding_window": getattr(attn.config, "sliding_window", None)},
    "Qwen2ForCausalLM": lambda attn: {"sliding_window": getattr(attn, "sliding_window", None)},
}


def _forward_of(module: Any) -> Callable[..., torch.Tensor]:
    """``module``'s own forward, bound, without ``__call__``'s hooks."""
    return type(module).forward.__get__(module)


class LeanStep:
    """The lean forward of one model (``of`` says whether it has one)."""

    def __init__(self, model: Any):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = model.model
        first = inner.layers[0].self_attn
        modeling = sys.modules[type(first).__module__]
        self.rope = modeling.apply_rotary_pos_emb
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation,
                                                               modeling.eager_attention_forward)
        self.extra = FAMILIES[type(model).__name__]
        self.layers = list(inner.layers[: model.config.num_hidden_layers])

    @classmethod
    def of(cls, model: Any) -> LeanStep | None:
        """The lean step of ``model`` if its family is known and its layers have the pieces
        it calls (None: decode through ``transformers``' forward)."""
        if type(model).__name__ not in FAMILIES:
            return None
        inner: Any = getattr(model, "model", None)
        if not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "rotary_emb", "norm")) \
                or not hasattr(model, "lm_head") or not len(inner.layers):
            return None
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not (hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")
                    and all(hasattr(attn, a) for a in ("head_dim", "scaling", "layer_idx"))
                    and hasattr(mlp, "act_fn")):
                return None
            if any(type(getattr(part, name, None)) is not nn.Linear for part, names in
                   ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")))
                   for name in names):
                return None
        return cls(model)

    def logits(self, model: Any, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               cache: Any) -> torch.Tensor:
        """The last position's logits of a step of ``ids`` (``[rows, 1]``) at ``positions``,
        its keys and values through ``cache`` (the paged adapter), as ``transformers``'
        forward computes them (NOTE [Lean decode steps])."""
        inner = model.model
        hidden = _forward_of(inner.embed_tokens)(ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            x = _forward_of(layer.input_layernorm)(hidden)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(shape).transpose(1, 2)
            k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(shape).transpose(1, 2)
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(shape).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx)
            out, _ = self.attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, position_ids=positions,
                                    use_cache=True, **self.extra(attn))
            out = out.reshape(*x.shape[:-1], -1).contiguous()
            hidden = residual + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            residual = hidden
            x = _forward_of(layer.post_attention_layernorm)(hidden)
            gate = _forward_of(mlp.act_fn)(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
            x = F.linear(gate * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                         mlp.down_proj.bias)
            hidden = residual + x
        hidden = _forward_of(inner.norm)(hidden)
        return F.linear(hidden[:, -1:], model.lm_head.weight, model.lm_head.bias)[:, -1]
