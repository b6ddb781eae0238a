"""What a request asks beyond its sampling parameters (issue 48, NOTE [Logit processing]),
in-process and with workers, against references computed from ``transformers``' own
logits on the same weights: the log-probabilities of greedy tokens and their top
alternatives, the prompt's log-probabilities (``echo``), repetition, presence and
frequency penalties, logit bias and ``min_tokens``; answers held to a hundred JSON schemas;
a step whose rows ask for none of it gives the tokens it gave before."""

from __future__ import annotations

import pytest
import torch

from tests.llm_reference import with_pools
from timeshare.bench.json_schemas import schemas
from timeshare.decode import runner
from timeshare.llm import hfdir
from timeshare.llm import model as lm
from timeshare.llm.constrained import OutputFormat
from timeshare.llm.sampling import SamplingParams
from timeshare.runtime.facade import Runtime

transformers = pytest.importorskip("transformers")

PROMPTS = ["the model switch fast", "a gpu load weights", "layer token fast slow memory host device"]
TOKENS = 12
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hfdir.write_model_dir(tmp_path_factory.mktemp("proc") / "llama", "llama", seed=5, hidden=96, layers=3)


@pytest.fixture(scope="module")
def hf(llama):
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    return tok, model


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "workers"])
def served(request, llama):
    with Runtime("cpu", with_pools("16MiB", [llama], max_context=256), workers=request.param) as rt:
        m = lm.load(rt, "llama", llama, max_context=256, max_sequences=8)
        yield m


def _logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids`` ([len, vocab], float32)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _reference(model, prompt: list[int], n: int, process) -> list[int]:
    """Greedy tokens from transformers' logits, each step's logits through ``process(ids,
    scores)`` (ids: the prompt and the tokens so far) before the argmax."""
    ids = list(prompt)
    for _ in range(n):
        scores = _logits(model, ids)[-1][None]
        ids.append(int(process(torch.tensor([ids]), scores).argmax(-1)))
    return ids[len(prompt):]


def test_greedy_tokens_log_probabilities_are_transformers_log_softmax_with_their_top_in_order(served, hf):
    tok, model = hf
    for text in PROMPTS:
        prompt = served.encode(text)
        done = served.generate(prompt, SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=5)).result(60)
        assert done.logprobs is not None and len(done.logprobs) == len(done.tokens)
        logp = torch.log_softmax(_logits(model, prompt + done.tokens[:-1]), -1)[len(prompt) - 1:]
        for i, (token, got) in enumerate(zip(done.tokens, done.logprobs)):
            assert got is not None
            assert got.logprob == pytest.approx(float(logp[i, token]), abs=TOLERANCE)
            values, ids = logp[i].topk(5)
            assert [t for t, _ in got.top] == ids.tolist()  # the most likely first
            assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
            assert got.top[0][0] == token  # greedy: the chosen one is the most likely


def test_the_prompts_log_probabilities_are_transformers_per_token_log_likelihood(served, hf):
    tok, model = hf
    prompt = served.encode(PROMPTS[2])
    # Twice: the second finds the prompt's pages cached, and still computes it whole.
    for _ in range(2):
        done = served.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)).result(60)
        assert done.prompt_logprobs is not None and len(done.prompt_logprobs) == len(prompt) - 1
        logp = torch.log_softmax(_logits(model, prompt), -1)
        for i, got in enumerate(done.prompt_logprobs):
            assert got.logprob == pytest.approx(float(logp[i, prompt[i + 1]]), abs=TOLERANCE)
            assert [t for t, _ in got.top] == logp[i].topk(3).indices.tolist()


@pytest.mark.parametrize("body", [True, False], ids=["by-chunks", "by-forward"])
def test_a_long_prompts_logits_are_never_held_whole(llama, hf, monkeypatch, body):
    """A scored prompt's output layer runs a chunk of positions at a time (by-chunks); a
    model whose head is more than its output layer is scored from its forward's logits
    (by-forward: the check made to disagree): the same log-probabilities either way."""
    tok, model = hf
    vocab = model.config.vocab_size
    monkeypatch.setattr(runner, "PROMPT_CHUNK", 8)
    if not body:
        monkeypatch.setattr(runner, "agrees", lambda got, want: False)
    widest: list[int] = []

    def logits_rows(module, args, out):
        if isinstance(out, torch.Tensor) and out.shape[-1] == vocab:
            widest.append(out.reshape(-1, vocab).shape[0])

    with Runtime("cpu", with_pools("16MiB", [llama], max_context=256), workers=0) as rt:
        m = lm.load(rt, "llama", llama, max_context=256, max_sequences=8)
        prompt = m.encode(" ".join(PROMPTS * 3))
        assert len(prompt) > 20
        with torch.nn.modules.module.register_module_forward_hook(logits_rows):
            done = m.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)).result(60)
    assert (max(widest) <= 8) == body
    logp = torch.log_softmax(_logits(model, prompt), -1)
    assert done.prompt_logprobs is not None and len(done.prompt_logprobs) == len(prompt) - 1
    for i, got in enumerate(done.prompt_logprobs):
        assert got.logprob == pytest.approx(float(logp[i, prompt[i + 1]]), abs=TOLERANCE)
        assert [t for t, _ in got.top] == logp[i].topk(2).indices.tolist()
    assert done.tokens == [int(logp[-1].argmax())]


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_is_transformers_processor(served, hf, penalty):
    tok, model = hf
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    for text in PROMPTS[:2]:
        prompt = served.encode(text)
        got = served.generate(prompt, SamplingParams(max_tokens=TOKENS, temperature=0,
                                                     repetition_penalty=penalty)).result(60).tokens
        assert got == _reference(model, prompt, TOKENS, processor)


def test_presence_and_frequency_penalties_are_openais_definitions(served, hf):
    tok, model = hf
    presence, frequency = 1.2, 0.8

    def penalize(ids, scores):
        generated = ids[0, len(prompt):]
        counts = torch.zeros_like(scores[0]).index_add_(0, generated, torch.ones(len(generated)))
        return scores - frequency * counts - presence * (counts > 0).float()

    for text in PROMPTS:
        prompt = served.encode(text)
        params = SamplingParams(max_tokens=TOKENS, temperature=0, presence_penalty=presence,
                                frequency_penalty=frequency)
        assert served.generate(prompt, params).result(60).tokens == _reference(model, prompt, TOKENS, penalize)


def test_logit_bias_and_min_tokens(served, hf):
    tok, model = hf
    prompt = served.encode(PROMPTS[0])
    plain = served.generate(prompt, SamplingParams(max_tokens=TOKENS, temperature=0)).result(60).tokens
    bias = ((plain[0], -100.0), (plain[1], -30.0))

    def biased(ids, scores):
        for token, b in bias:
            scores[0, token] += b
        return scores

    got = served.generate(prompt, SamplingParams(max_tokens=TOKENS, temperature=0, logit_bias=bias)).result(60)
    assert got.tokens == _reference(model, prompt, TOKENS, biased) and got.tokens[0] != plain[0]
    # The end token pushed up: it comes as soon as min_tokens lets it, and ends the answer.
    eos = tok.eos_token_id
    done = served.generate(prompt, SamplingParams(max_tokens=TOKENS, temperature=0, logit_bias=((eos, 100.0),),
                                                  min_tokens=4)).result(60)
    assert done.finish_reason == "stop" and len(done.tokens) == 5 and done.tokens[-1] == eos
    assert eos not in done.tokens[:4]


def test_a_batch_mixing_rows_that_ask_and_rows_that_do_not_gives_each_its_own(served, hf):
    tok, model = hf
    plain = SamplingParams(max_tokens=TOKENS, temperature=0)
    alone = [served.generate(served.encode(t), plain).result(60).tokens for t in PROMPTS]
    asks = [SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=2),
            plain,
            SamplingParams(max_tokens=TOKENS, temperature=0, repetition_penalty=1.5)]
    seqs = [served.generate(served.encode(t), p) for t, p in zip(PROMPTS, asks)]
    done = [s.result(60) for s in seqs]
    assert done[0].tokens == alone[0] and done[0].logprobs is not None
    assert done[1].tokens == alone[1] and done[1].logprobs is None
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.5)
    assert done[2].tokens == _reference(model, served.encode(PROMPTS[2]), TOKENS, processor)


def test_sampling_params_refuse_what_is_out_of_range():
    from timeshare.errors import ConfigError

    for bad in ({"logprobs": 21}, {"logprobs": -1}, {"prompt_logprobs": True}, {"presence_penalty": 2.5},
                {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"logit_bias": ((5, 101.0),)},
                {"logit_bias": ((-1, 1.0),)}, {"min_tokens": 17}):
        with pytest.raises(ConfigError):
            SamplingParams(max_tokens=16, **bad)


def test_a_hundred_json_schemas_every_answer_validates_greedy_and_sampled(served):
    """NOTE [Constrained decoding]: schemas drawn with nested objects, arrays, enums,
    required fields, bounded numbers and patterned strings (``bench/json_schemas.py``) on a
    model with a byte-level tokenizer; random weights, so the grammar alone makes the
    answers valid."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    drawn = schemas(100, seed=48)
    prompt = served.encode("an answer in json")
    asked = [(s, SamplingParams(max_tokens=220, temperature=t, seed=i, output=OutputFormat.json_schema(s)))
             for i, s in enumerate(drawn) for t in (0.0, 1.0)]
    for at in range(0, len(asked), 8):  # eight at a time: one batch
        group = asked[at:at + 8]
        seqs = [served.generate(prompt, params) for _, params in group]
        for (schema, _), seq in zip(group, seqs):
            done = seq.result(120)
            assert done.finish_reason == "stop", (schema, done.text)
            jsonschema.validate(json.loads(done.text), schema)


def test_the_same_requests_give_the_same_text_and_numbers_in_process_and_with_workers(llama):
    """One engine in both modes (NOTE [One step, two places]): seeded sampled answers with
    penalties, a bias and log-probabilities, and answers held to a schema, token for token
    and log-probability for log-probability."""
    drawn = schemas(4, seed=7)
    asks = [SamplingParams(max_tokens=TOKENS, temperature=0.9, seed=i, logprobs=2, presence_penalty=0.5,
                           frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=((5, 3.0),))
            for i in range(3)]
    asks += [SamplingParams(max_tokens=200, temperature=1.0, seed=10 + i, output=OutputFormat.json_schema(s))
             for i, s in enumerate(drawn)]
    got = {}
    for workers in (0, 2):
        with Runtime("cpu", with_pools("16MiB", [llama], max_context=256), workers=workers) as rt:
            m = lm.load(rt, "llama", llama, max_context=256, max_sequences=8)
            prompts = [m.encode(t) for t in PROMPTS]
            seqs = [m.generate(prompts[i % len(prompts)], p) for i, p in enumerate(asks)]
            got[workers] = [(d.text, d.tokens, d.logprobs) for d in (s.result(120) for s in seqs)]
    assert got[0] == got[2]
