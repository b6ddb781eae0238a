"""llguidance against xgrammar for structured outputs (issue 48's choice, NOTE [Constrained
decoding]): the time to compile a JSON schema, the time to compute one token's mask as an
answer is generated (a random walk through the grammar: each step a token the mask
allows), over a byte-level BPE vocabulary of ``--vocab`` tokens, and how many of
``--schemas`` generated schemas each compiles. Prints JSON. xgrammar is imported from
``--xgrammar-path`` (it is not a dependency: ``pip install --no-deps --target DIR
xgrammar apache-tvm-ffi``).

    python scripts/grammar_libraries.py --xgrammar-path /tmp/xg
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def tokenizer(vocab: int, seed: int = 0):
    """A byte-level BPE tokenizer of ``vocab`` tokens: printable pieces of 1 to 8
    characters, the special tokens, no merges needed for masks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120", "\u010a"]
    pieces = {"<s>": 0, "</s>": 1, "<unk>": 2, "<pad>": 3}
    for ch in alphabet:
        pieces.setdefault(ch, len(pieces))
    while len(pieces) < vocab:
        pieces.setdefault("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))), len(pieces))
    tok = Tokenizer(models.BPE(vocab=pieces, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def allowed(mask: bytes | list, vocab: int) -> list[int]:
    if isinstance(mask, list):
        words = mask
    else:
        words = [int.from_bytes(mask[i:i + 4], "little") for i in range(0, len(mask), 4)]
    return [t for t in range(vocab) if words[t >> 5] >> (t & 31) & 1]


def walk_llguidance(tok, schemas, steps: int, rng: random.Random) -> dict:
    import llguidance
    import llguidance.hf

    lt = llguidance.hf.from_tokenizer(tok)
    compiled, compile_s, mask_s = 0, [], []
    for s in schemas:
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False})
        if llguidance.LLMatcher.validate_grammar(grammar, lt):  # an error's message
            continue
        m = llguidance.LLMatcher(lt, grammar)
        compile_s.append(time.perf_counter() - t0)
        compiled += 1
        for _ in range(steps):
            if m.is_stopped():
                break
            t0 = time.perf_counter()
            mask = m.compute_bitmask()
            mask_s.append(time.perf_counter() - t0)
            choices = allowed(mask, lt.vocab_size)
            if not choices:
                break
            m.consume_token(rng.choice(choices))
    return _summary("llguidance", compiled, len(schemas), compile_s, mask_s)


def walk_xgrammar(tok, schemas, steps: int, rng: random.Random) -> dict:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    compiled, compile_s, mask_s = 0, [], []
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for s in schemas:
        t0 = time.perf_counter()
        try:
            grammar = compiler.compile_json_schema(json.dumps(s), any_whitespace=False)
        except Exception:
            continue
        m = xgr.GrammarMatcher(grammar)
        compile_s.append(time.perf_counter() - t0)
        compiled += 1
        for _ in range(steps):
            if m.is_terminated():
                break
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            mask_s.append(time.perf_counter() - t0)
            choices = allowed(bitmask[0].to(torch.int64).remainder(1 << 32).tolist(), info.vocab_size)
            if not choices:
                break
            m.accept_token(rng.choice(choices))
    return _summary("xgrammar", compiled, len(schemas), compile_s, mask_s)


def _summary(name: str, compiled: int, total: int, compile_s: list[float], mask_s: list[float]) -> dict:
    ordered = sorted(mask_s)
    return {"library": name, "schemas_compiled": compiled, "schemas": total,
            "compile_ms_median": 1e3 * statistics.median(compile_s) if compile_s else None,
            "mask_us_median": 1e6 * statistics.median(ordered) if ordered else None,
            "mask_us_p99": 1e6 * ordered[int(0.99 * (len(ordered) - 1))] if ordered else None,
            "masks": len(ordered)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--schemas", type=int, default=100)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--xgrammar-path", default=None)
    args = p.parse_args()
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from timeshare.bench.json_schemas import schemas

    tok = tokenizer(args.vocab)
    drawn = schemas(args.schemas, seed=1)
    results = [walk_llguidance(tok, drawn, args.steps, random.Random(0))]
    try:
        results.append(walk_xgrammar(tok, drawn, args.steps, random.Random(0)))
    except ImportError as exc:
        results.append({"library": "xgrammar", "error": str(exc)})
    print(json.dumps({"vocab": len(tok), "results": results}, indent=1))


if __name__ == "__main__":
    main()
