"""Hugging Face model directories, as users have them: ``config.json``, safetensors
shards (with ``model.safetensors.index.json``), tokenizer files and a chat template. This
module writes such directories from code (a small decoder-only model of a named
architecture with seeded weights, and a byte-level BPE tokenizer trained with the
``tokenizers`` library on a seeded corpus), since nothing may be downloaded, and reads them
back for the runtime: the module built from the config by ``transformers``, its weights
from the shards. Runs in the controller (and ``build_causal_lm`` in worker processes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from torch import nn

from timeshare.errors import ConfigError, WeightsError
from timeshare.seeding import seeded

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2")  # decoder-only language models
ENCODERS = ("bert",)  # ``BertModel``: served through the Open Inference Protocol and /v1/embeddings
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
# NOTE [Tool calls]: the tools offered, and an assistant's earlier calls as Hermes-style
# <tool_call> blocks, as the templates of Qwen2.5 and others render them.
CHAT_TEMPLATE = ("{% if tools %}<s>tools: {{ tools | tojson }}</s>{% endif %}"
                 "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
                 "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
                 "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% endif %}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
_WORDS = ("the a model switch gpu time share load weights layer token fast slow memory host device cache "
          "group stream copy wake sleep serve request answer").split()


def write_model_dir(path: str | Path, arch: str = "llama", *, seed: int = 0, hidden: int = 64, layers: int = 2,
                    heads: int = 4, vocab: int = 320, max_positions: int = 256,
                    max_shard_size: str = "200KB") -> Path:
    """A model directory at ``path`` for a tiny ``arch`` model: seeded weights saved in
    safetensors shards of at most ``max_shard_size``, a tokenizer of about ``vocab``
    tokens, a chat template. Returns the path."""
    from transformers import AutoModel, AutoModelForCausalLM

    if arch not in ARCHITECTURES + ENCODERS:
        raise ConfigError(f"unknown architecture {arch!r}; known: {list(ARCHITECTURES + ENCODERS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _write_tokenizer(path, vocab, seed)
    config = _config(arch, len(tokenizer), hidden, layers, heads, max_positions,
                     (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id))
    with seeded(seed):  # the caller's random state left alone (NOTE [One random state per process])
        model = (AutoModel if arch == "bert" else AutoModelForCausalLM).from_config(config)
    model.eval().save_pretrained(path, max_shard_size=max_shard_size)
    return path


def _config(arch: str, vocab: int, hidden: int, layers: int, heads: int, max_positions: int,
            tokens: tuple[int, int, int]):
    """The ``transformers`` config of a tiny ``arch`` model; ``tokens``: its bos, eos and
    pad token ids (the tokenizer's)."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    bos, eos, pad = tokens
    if arch == "bert":
        return BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          intermediate_size=2 * hidden, max_position_embeddings=max_positions, pad_token_id=pad)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions,
                          bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,
               max_position_embeddings=max_positions, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def _write_tokenizer(path: Path, vocab: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Printable ASCII, space and newline only (byte-level BPE's names for them: a space is
    # "Ġ", a newline "Ċ"), not all 256 bytes: every token then decodes to valid text, as a
    # trained model's output does, even from random weights (a token holding half of a
    # multi-byte character would make streamed text wait for the rest).
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120", "\u010a"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS),
                                                        initial_alphabet=alphabet, limit_alphabet=len(alphabet)))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_causal_lm(path: str) -> nn.Module:
    """The model of the directory ``path``, built from its config (weights at their
    initial values: the runtime binds them to its own memory). Top-level, so that worker
    processes can rebuild it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def build_module(path: str) -> nn.Module:
    """The model of the directory ``path`` as the class its config.json names (an encoder
    such as ``BertModel``, a classifier such as ``BertForSequenceClassification``), built
    from its config in eval mode. Top-level, so that worker processes can rebuild it."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ConfigError(f"{path}: its config names no model class transformers has ({names})")
    return cls(config).eval()


def weights_dtype(shards: list[str]) -> torch.dtype:
    """The floating dtype most of a model's weights have in its shards (read from their
    headers): the dtype it computes in when registered as the directory has it."""
    from collections import Counter

    from timeshare.transfer.safetensors_index import SafetensorsIndex

    counts: Counter[torch.dtype] = Counter()
    for t in SafetensorsIndex.read_many(shards).tensors.values():
        if t.dtype.is_floating_point:
            counts[t.dtype] += t.end - t.start
    return counts.most_common(1)[0][0] if counts else torch.float32


def shard_files(path: str | Path) -> list[Path]:
    """The directory's safetensors files: those its index names, or the one file."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: not a safetensors index ({exc})") from None
        shards = [path / f for f in files]
    else:
        shards = sorted(path.glob("*.safetensors"))
    missing = [str(s) for s in shards if not s.is_file()]
    if not shards or missing:
        raise WeightsError(f"model directory {str(path)!r} has no safetensors weights"
                           + (f" (missing: {missing})" if missing else ""))
    return shards


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's shards, by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in shard_files(path):
        try:
            part = load_file(str(shard))
        except Exception as exc:
            raise WeightsError(f"{shard}: cannot be read as safetensors ({exc})") from None
        overlap = tensors.keys() & part.keys()
        if overlap:
            raise WeightsError(f"{shard}: tensors also in another shard: {sorted(overlap)[:3]}")
        tensors.update(part)
    return tensors

