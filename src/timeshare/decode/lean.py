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
attention passes), and each projection's own weight and bias.

The projections are most of a step, and for a step's few rows ``F.linear`` (MKL's sgemm
on PyTorch's CPU builds) reads the weights at about a third of the memory's bandwidth:
measured on the 2-core VM, 10 GB/s for 8 rows of a 768 x 768 projection where reading
the same bytes runs at 28-31 GB/s. oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``,
the one ``torch.compile`` emits for a CPU linear) reads them at 14-15 GB/s: a 64M model's
step at 1 and 8 rows about 1.4x faster, with no copy of any weight (a prepacked copy would
be faster still, but would double the weights' memory). But a oneDNN call costs about 11
us more than ``F.linear``'s before it reads a byte, so it pays only from about 2 MiB of
weights (measured on the same VM at 1 and 2 threads: 512 x 512 and 1,024 x 256 float32
projections faster with ``F.linear``, 1,024 x 512 equal, 2,048 x 256 and larger faster with
oneDNN); the 9 MiB Llama of ``bench llm --peer`` has 29 projections a step, all below.
The lean step uses oneDNN for the projections of at least ``ONEDNN_MIN_BYTES`` where it
runs (a CPU build with oneDNN, the weights' dtype; ``linear_of`` tries it once), else
``F.linear``. Its float32 norms are ``F.rms_norm``, one operator where the modeling file's
norm is seven (the same operations in the same order: the same bits).

Its rounding differs from MKL's in the last bits (a logit off by about 1e-6), so being
the same computation is checked within a bound, not assumed: a runner's first eager step
runs both, and uses the lean step from then on only if every logit and every new key
and value is within ``agrees``' bound of ``transformers``' (for float32, 1e-4 of their
largest magnitude: a missing bias, a wrong rotary or norm is off by far more) and each
row's greedy token is the same; else it warns and keeps ``transformers``' forward.
Neither kernel gives a row the same bits in every batch size (MKL's and oneDNN's blocking
depend on the rows), which is why greedy tokens are compared with ``transformers``'
``generate`` batch size by batch size, as before. Only eager steps on the CPU use it: on
CUDA a captured graph replays kernels, where Python costs nothing, a compiled step is
traced from ``transformers``' forward, the eager steps between a relayout and the next
capture are few, and the comparison would wait for the device. Any other architecture
decodes through ``transformers``' forward.
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


# How far a lean step's logits and keys and values may be from transformers' forward, as
# a fraction of their largest magnitude, by dtype (NOTE [Lean decode steps]).
BOUNDS = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 2e-2, torch.float16: 5e-3}

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# A projection's output corrected by its rows' adapters: (the projection, its input, its output).
Adapt = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

# The norms whose forward is ``F.rms_norm``'s computation: to float32, the mean square, its
# reciprocal square root, back to the input's dtype, times the weight.
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})

ONEDNN_MIN_BYTES = 2 << 20  # a projection's weights from which oneDNN's matmul is faster (NOTE [Lean decode steps])


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear_of(weight: torch.Tensor) -> Linear:
    """The projection of a lean step over weights like ``weight``: oneDNN's matmul where it
    runs for their device and dtype and gives ``F.linear``'s result within the bound, else
    ``F.linear`` (NOTE [Lean decode steps])."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return F.linear
    try:
        probe = torch.linspace(-1, 1, 6 * 8, dtype=weight.dtype).view(6, 8)
        x = torch.linspace(1, -1, 3 * 8, dtype=weight.dtype).view(3, 1, 8)
        bias = torch.linspace(0, 1, 6, dtype=weight.dtype)
        if agrees(_onednn_linear(x, probe, bias), F.linear(x, probe, bias)):
            return _onednn_linear
    except (RuntimeError, AttributeError, NotImplementedError):  # a build without it, a dtype it lacks
        pass
    return F.linear


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``got`` is ``want`` within the bound of their dtype (NOTE [Lean decode steps])."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if torch.equal(got, want):
        return True
    bound = BOUNDS.get(want.dtype, 0.0) * max(1.0, want.abs().max().item())
    if not torch.equal(torch.isfinite(got), torch.isfinite(want)):
        return False
    return (got - want).nan_to_num().abs().max().item() <= bound


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
        fast = linear_of(model.lm_head.weight)

        def kernel(proj: nn.Linear) -> Linear:
            w = proj.weight
            return fast if w.numel() * w.element_size() >= ONEDNN_MIN_BYTES else F.linear

        # Each layer's kernels, in the order the step calls them: q, k, v, o, gate, up, down.
        self.kernels = [tuple(kernel(p) for p in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                  layer.self_attn.v_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))
                        for layer in self.layers]
        self.head = kernel(model.lm_head)

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
               cache: Any, lora: Adapt | None = None) -> torch.Tensor:
        """The last position's logits of a step of ``ids`` (``[rows, 1]``) at ``positions``,
        its keys and values through ``cache`` (the paged adapter), as ``transformers``'
        forward computes them (NOTE [Lean decode steps]); ``lora``: each projection's
        output corrected by its rows' adapters (NOTE [Adapters in slots])."""
        inner = model.model

        def project(kernel: Linear, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            out = kernel(x, proj.weight, proj.bias)
            return out if lora is None else lora(proj, x, out)

        hidden = _forward_of(inner.embed_tokens)(ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=positions)
        for layer, (lq, lk, lv, lo, lg, lu, ld) in zip(self.layers, self.kernels):
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            x = _norm(layer.input_layernorm, hidden)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q = project(lq, attn.q_proj, x).view(shape).transpose(1, 2)
            k = project(lk, attn.k_proj, x).view(shape).transpose(1, 2)
            v = project(lv, attn.v_proj, x).view(shape).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx)
            out, _ = self.attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, position_ids=positions,
                                    use_cache=True, **self.extra(attn))
            out = out.reshape(*x.shape[:-1], -1).contiguous()
            hidden = residual + project(lo, attn.o_proj, out)
            residual = hidden
            x = _norm(layer.post_attention_layernorm, hidden)
            gate = _forward_of(mlp.act_fn)(project(lg, mlp.gate_proj, x))
            hidden = residual + project(ld, mlp.down_proj, gate * project(lu, mlp.up_proj, x))
        hidden = _norm(inner.norm, hidden)
        return self.head(hidden[:, -1:], model.lm_head.weight, model.lm_head.bias)[:, -1]


def _norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """A float32 RMS norm of the Llama family (``weight``, ``variance_epsilon``) as one
    operator, bit for bit; any other norm or dtype through the norm's own forward (it
    rounds to the input's dtype before the weight, ``F.rms_norm`` after)."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or hidden.dtype != torch.float32 or type(norm).__name__ not in RMS_NORMS:
        return _forward_of(norm)(hidden)
    return F.rms_norm(hidden, hidden.shape[-1:], norm.weight, eps)
