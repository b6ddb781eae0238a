"""``timeshare bench llm --peer vllm``: one model directory served by ``timeshare serve``
(in-process and with workers) and by vLLM, in each run the servers started one at a time
and then taking turns round by round (NOTE [Interleaved servers]), the same requests sent
to each through its OpenAI API: time to ready, time to first token (a short prompt, a
server's first long prompt, new long prompts after it, each long prompt again with a new
last word), decode tokens/s of one
request and of 8 at once, the memory of the server's processes, and whether the greedy
text is ``transformers``'. Runs in the CLI's process; the servers are child processes,
vLLM in a Python of its own (``make vllm-venv``), never imported here.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from timeshare.bench.environment import describe
from timeshare.errors import ConfigError, TimeshareError
from timeshare.harness.process import descendants, wait_ready
from timeshare.llm import hfdir

PEERS = ("vllm",)
MODES = ("in-process", "workers")
MODEL = "m"  # the name both servers serve the model under
WORDS = ("the model switch fast load weights layer token a gpu share time memory host device cache group "
         "stream copy wake sleep serve request answer slow").split()
VLLM_PYTHON_ENV = "TIMESHARE_VLLM_PYTHON"
# What one request of each kind measures, and how it is summed up across runs.
METRICS = ("ready_s", "ttft_short_s", "ttft_long_first_s", "ttft_long_new_s", "ttft_prefix_s",
           "decode_1_tokens_per_s", "e2e_1_tokens_per_s", "decode_8_tokens_per_s", "e2e_8_decode_tokens_per_s",
           "total_8_tokens_per_s", "memory_bytes")
# Those measured in every round (NOTE [Interleaved servers]): paired round by round.
ROUND_METRICS = ("decode_1_tokens_per_s", "e2e_1_tokens_per_s", "decode_8_tokens_per_s", "e2e_8_decode_tokens_per_s",
                 "total_8_tokens_per_s")
LOWER_IS_BETTER = {"ready_s", "ttft_short_s", "ttft_long_first_s", "ttft_long_new_s", "ttft_prefix_s",
                   "memory_bytes"}


@dataclass
class PeerBenchConfig:
    peer: str = "vllm"
    python: str | None = None  # the peer's Python (default: $TIMESHARE_VLLM_PYTHON, then .venv-vllm/bin/python)
    runs: int = 3
    new_tokens: int = 64
    prompt_words: int = 48  # the decode requests' prompts
    long_words: int = 1500  # the long prompt's words (a token each)
    longs: int = 3  # new long prompts in each run, each then with another last word (NOTE [Interleaved servers])
    concurrent: int = 8
    repeats: int = 5  # rounds in each run, the servers taking turns (NOTE [Interleaved servers])
    modes: tuple[str, ...] = MODES
    workers: int = 2
    hidden: int = 256  # the model: Llama-shaped, written from code (seeded)
    layers: int = 4
    heads: int = 4
    max_context: int = 4096
    kv_space_gib: int = 2  # vLLM's VLLM_CPU_KVCACHE_SPACE
    ready_timeout_s: float = 600.0
    seed: int = 0
    workdir: str | None = None

    def __post_init__(self):
        if self.peer not in PEERS:
            raise ConfigError(f"peer must be one of {list(PEERS)}, got {self.peer!r}")
        self.modes = tuple(self.modes)
        if not self.modes or set(self.modes) - set(MODES):
            raise ConfigError(f"modes must be one or both of {', '.join(MODES)}, got {list(self.modes)}")
        if min(self.runs, self.prompt_words, self.concurrent, self.repeats) < 1 or self.new_tokens < 2 \
                or self.longs < 2:
            raise ConfigError("runs, prompt_words, concurrent and repeats must be at least 1, longs at least 2 "
                              "(the first and a new one), new_tokens at least 2")
        if self.long_words + self.new_tokens + 8 > self.max_context:
            raise ConfigError(f"a long prompt of {self.long_words} words and {self.new_tokens} tokens does not fit "
                              f"a context of {self.max_context}")

    def peer_python(self) -> Path:
        """The Python that has the peer installed; a clear error where there is none."""
        given = self.python or os.environ.get(VLLM_PYTHON_ENV)
        path = Path(given) if given else Path(".venv-vllm/bin/python")
        if not path.exists():
            raise ConfigError(f"no Python with vLLM at {path}: build one with `make vllm-venv`, or pass "
                              f"--peer-python or set {VLLM_PYTHON_ENV}")
        return path


@dataclass(frozen=True)
class Prompts:
    """The texts every server gets, the same in every run: ``short``; for each of the
    config's repeats, ``singles`` (the one request decoding alone), ``manys`` (one per
    concurrent request) and ``firsts`` (as many, as long, asked for one token each); ``longs``
    (``config.longs`` of them, their words drawn apart) and ``prefixes`` (each long prompt
    with another last word). No text is sent twice to a server, so that what its prefix
    cache holds is the same for every server: the long prompts' pages only."""

    short: str
    singles: tuple[str, ...]
    manys: tuple[tuple[str, ...], ...]
    firsts: tuple[tuple[str, ...], ...]
    longs: tuple[str, ...]
    prefixes: tuple[str, ...]

    @property
    def decoded(self) -> list[str]:
        """The prompts whose text is compared: the single requests', then the concurrent ones'."""
        return [*self.singles, *(p for many in self.manys for p in many)]

    @classmethod
    def make(cls, config: PeerBenchConfig) -> Prompts:
        rng = random.Random(config.seed)

        def words(n: int) -> str:
            return " ".join(rng.choice(WORDS) for _ in range(n))

        def group() -> tuple[str, ...]:
            return tuple(words(config.prompt_words) for _ in range(config.concurrent))

        singles = tuple(words(config.prompt_words) for _ in range(config.repeats))
        manys = tuple(group() for _ in range(config.repeats))
        firsts = tuple(group() for _ in range(config.repeats))
        longs = tuple(words(config.long_words) for _ in range(config.longs))

        def other_last(text: str) -> str:
            head, last = text.rsplit(" ", 1)
            return head + " " + next(w for w in WORDS if w != last)

        return cls(words(4), singles, manys, firsts, longs, tuple(other_last(t) for t in longs))


# ---------------------------------------------------------------------- servers
class Server(Protocol):
    """One server in a child process: ``start`` (waits until it answers HTTP, with a
    deadline; the bench then waits for its first completion: ``first_answer``), ``url``,
    ``pids`` (its processes, for their memory), ``stop``."""

    name: str
    url: str

    def start(self) -> None: ...

    def pids(self) -> list[int]: ...

    def stop(self) -> None: ...


class TimeshareServer:
    def __init__(self, path: Path, mode: str, config: PeerBenchConfig):
        from timeshare.harness.process import ServerProcess

        self.name = f"timeshare {mode}"
        workers = config.workers if mode == "workers" else 0
        doc = {"runtime": {"device": "cpu", "workers": workers},
               "llms": [{"name": MODEL, "path": str(path), "max_context": config.max_context,
                         "max_sequences": max(8, config.concurrent)}]}
        self._server = ServerProcess(doc, ready_timeout_s=config.ready_timeout_s)
        self.url = self._server.url

    def start(self) -> None:
        self._server.start()

    def pids(self) -> list[int]:
        return [self._server.pid, *descendants(self._server.pid)]

    def stop(self) -> None:
        self._server.close()


class VLLMServer:
    """vLLM's OpenAI server as its CPU build is started (``vllm serve`` fails there: the
    package is named vllm-cpu), float32 like the model directory, its key/value cache
    ``kv_space_gib``."""

    def __init__(self, path: Path, config: PeerBenchConfig):
        from timeshare.harness.process import free_port

        self.name = "vllm"
        self.python, self.path, self.config = config.peer_python(), path, config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="timeshare-vllm-")
        self.log_path = Path(self._dir.name) / "vllm.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        import httpx

        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_space_gib), "PYTHONUNBUFFERED": "1"}
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.path),
                   "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len",
                   str(self.config.max_context), "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:  # its own session: stopped with all its processes
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

        def answers() -> bool:
            try:
                return httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_ready(self.proc, answers, self.config.ready_timeout_s, "vLLM", self._tail)
        except TimeshareError:
            self.stop()
            raise

    def pids(self) -> list[int]:
        assert self.proc is not None
        return [self.proc.pid, *descendants(self.proc.pid)]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._dir.cleanup()

    def _tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def memory_bytes(pids: list[int]) -> int:
    """The proportional set size of ``pids`` together: each shared page (a model's weights
    mapped by several processes) counted once in all."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


# ---------------------------------------------------------------------- requests
@dataclass
class Streamed:
    """One streamed completion: when it was sent, when each text chunk came, its text and
    its completion tokens (from the final usage chunk)."""

    sent: float
    chunks: list[float]
    text: str
    tokens: int
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.chunks[0] - self.sent if self.chunks else float("nan")


async def _complete(client: Any, prompt: str, max_tokens: int) -> Streamed:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    chunks: list[float] = []
    text: list[str] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Streamed(sent, [], "", 0, f"HTTP {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Streamed(sent, chunks, "".join(text), tokens, str(chunk["error"]))
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    chunks.append(time.monotonic())
                    text.append(choice["text"])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return Streamed(sent, chunks, "".join(text), tokens)


def first_answer(url: str, prompt: str, timeout_s: float) -> None:
    """Wait until ``url`` completes ``prompt`` (a server may answer HTTP while its model
    still loads: 503 until then); an error past ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    while True:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            if r.status_code == 200:
                return
            if r.status_code != 503:
                raise TimeshareError(f"{url}: the first completion failed: HTTP {r.status_code}: {r.text[:300]}")
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeshareError(f"{url}: no completion within {timeout_s:.0f} s of its start")
        time.sleep(0.1)


def _decode_rate(streams: list[Streamed]) -> float:
    """Tokens after each stream's first over the time from the last first token to the
    last token: every stream decodes in that window."""
    start = max(s.chunks[0] for s in streams)
    end = max(s.chunks[-1] for s in streams)
    tokens = sum(s.tokens - 1 for s in streams)
    return tokens / (end - start) if end > start else float("nan")


@dataclass
class Round:
    """One server's round: its rates (``ROUND_METRICS`` and the windows they come from;
    ``at``: when it began), the single request and the concurrent ones."""

    rates: dict[str, float]
    single: Streamed
    many: list[Streamed]


async def _round(client: Any, url: str, prompts: Prompts, i: int, config: PeerBenchConfig) -> Round:
    """Round ``i`` on one server: the single request decoding alone, as many one-token
    requests at once as there are concurrent ones (their prefills), then the concurrent
    requests."""
    async def one(prompt: str, max_tokens: int) -> Streamed:
        return await _checked(client, url, prompt, max_tokens)

    at = time.monotonic()
    single = await one(prompts.singles[i], config.new_tokens)
    started = time.monotonic()
    firsts = await asyncio.gather(*(one(p, 1) for p in prompts.firsts[i]))
    prefills = max(s.chunks[-1] for s in firsts) - started  # as many prompts, one token each
    started = time.monotonic()
    many = list(await asyncio.gather(*(one(p, config.new_tokens) for p in prompts.manys[i])))
    finished = max(s.chunks[-1] for s in many)
    # The windows the decode rates are measured over: a server that holds a stream's chunks
    # back and sends them together (vLLM-cpu 0.32 at times: every token of a 0.3 s request
    # within 1 ms) shows a window far shorter than its requests took, and a decode rate that
    # means nothing; the end-to-end rates still hold: one request's (its first token
    # included), and the 8 requests' tokens after their first over the time they took
    # beyond that of 8 as long prompts asked for one token each (their prefills).
    rates = {
        "at": at,
        "decode_1_tokens_per_s": _decode_rate([single]),
        "e2e_1_tokens_per_s": single.tokens / (single.chunks[-1] - single.sent),
        "decode_1_window_s": single.chunks[-1] - single.chunks[0],
        "decode_1_request_s": single.chunks[-1] - single.sent,
        "decode_8_window_s": finished - max(s.chunks[0] for s in many),
        "decode_8_requests_s": finished - started,
        "decode_8_tokens_per_s": _decode_rate(many),
        "e2e_8_decode_tokens_per_s": sum(s.tokens - 1 for s in many) / max(finished - started - prefills, 1e-9),
        "prefill_8_s": prefills,
        "total_8_tokens_per_s": sum(s.tokens for s in many) / (finished - started)}
    return Round(rates, single, many)


async def _checked(client: Any, url: str, prompt: str, max_tokens: int) -> Streamed:
    s = await _complete(client, prompt, max_tokens)
    if s.error is not None or not s.chunks:
        raise TimeshareError(f"{url}: a completion failed: {s.error or 'no text came back'}")
    return s


def _turns(names: list[str], k: int) -> list[str]:
    """``names`` rotated by ``k``: who goes first changes from round to round."""
    k %= len(names)
    return names[k:] + names[:k]


def cpu_ticks(pids: list[int]) -> int:
    """The CPU time ``pids`` have used so far, in clock ticks (gone processes: none)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


async def settle(pids: Callable[[], list[int]], *, interval_s: float = 0.1, idle_ticks: int = 1,
                 timeout_s: float = 10.0) -> float:
    """Wait until the processes ``pids()`` names use next to no CPU (at most ``idle_ticks``
    over ``interval_s``, twice in a row), at most ``timeout_s``; the seconds waited.
    vLLM-cpu's worker keeps a core busy for about a second after its last request (its
    thread spins, pinned to core 0): the next server's requests would share that core."""
    started = time.monotonic()
    quiet, before = 0, cpu_ticks(pids())
    while quiet < 2 and time.monotonic() - started < timeout_s:
        await asyncio.sleep(interval_s)
        now = cpu_ticks(pids())
        quiet = quiet + 1 if now - before <= idle_ticks else 0
        before = now
    return time.monotonic() - started


async def _measure_async(servers: dict[str, Server], prompts: Prompts, config: PeerBenchConfig,
                         run: int) -> dict[str, dict]:
    """Every measure of one run on every server, the servers all up and taking turns
    request group by request group (NOTE [Interleaved servers]): each server's medians
    of its rounds, its rounds' rates, its first-token times and its greedy texts."""
    import httpx

    urls = {name: server.url for name, server in servers.items()}
    names = list(urls)

    def every_pid() -> list[int]:
        return [pid for server in servers.values() for pid in server.pids()]

    clients = {n: httpx.AsyncClient(base_url=u, timeout=httpx.Timeout(600.0)) for n, u in urls.items()}
    try:
        shorts: dict[str, list[Streamed]] = {}
        for name in _turns(names, run):
            await settle(every_pid)
            await _checked(clients[name], urls[name], prompts.short, 4)  # warm: its first request
            shorts[name] = [await _checked(clients[name], urls[name], prompts.short + f" {w}", 1) for w in WORDS[:3]]
        rounds: dict[str, list[Round]] = {n: [] for n in names}
        for i in range(len(prompts.singles)):
            for name in _turns(names, run + i):
                await settle(every_pid)
                rounds[name].append(await _round(clients[name], urls[name], prompts, i, config))
        longs: dict[str, list[Streamed]] = {n: [] for n in names}
        prefixes: dict[str, list[Streamed]] = {n: [] for n in names}
        for k, (long, prefix) in enumerate(zip(prompts.longs, prompts.prefixes)):
            for name in _turns(names, run + k):
                await settle(every_pid)
                longs[name].append(await _checked(clients[name], urls[name], long, 1))
                prefixes[name].append(await _checked(clients[name], urls[name], prefix, 1))
    finally:
        for client in clients.values():
            await client.aclose()
    out: dict[str, dict] = {}
    for name in names:
        rates = [r.rates for r in rounds[name]]
        singles = [r.single for r in rounds[name]]
        manys = [r.many for r in rounds[name]]
        medians = {key: statistics.median(r[key] for r in rates) for key in rates[0] if key != "at"}
        out[name] = medians | {
            "rounds": rates, "ttft_short_s": statistics.median(s.ttft_s for s in shorts[name]),
            "decode_1_tokens": min(s.tokens for s in singles),
            "decode_8_tokens": [min(m[i].tokens for m in manys) for i in range(len(manys[0]))],
            # A server's first long prompt pays what its process has not done yet (fresh
            # memory for the activations: 190 ms against 150 for the next, timeshare
            # in-process alone; vLLM's start-up profile run has done it): apart.
            "ttft_long_first_s": longs[name][0].ttft_s,
            "ttft_long_new_s": statistics.median(s.ttft_s for s in longs[name][1:]),
            "ttft_prefix_s": statistics.median(s.ttft_s for s in prefixes[name]),
            "texts": [*(s.text for s in singles), *(s.text for many in manys for s in many)]}
    return out


# ---------------------------------------------------------------------- the run
# NOTE [Interleaved servers]
# On a shared VM the same server's decode rate moves by a third from one minute to the next
# (issue 46: 247 and 410 tokens/s a few minutes apart, same build), more than the gaps
# being measured. So the servers of a run are not measured one after the other: they are
# all started (one at a time, each timed to its first completion while the others idle;
# an idle vLLM or timeshare server takes under 2% of a core), and then take turns, one
# round each (the single request, the prefills, the concurrent requests: a few seconds),
# the order rotated from round to round and run to run. A round of ours and the peer's
# round next to it see the same machine, and each ratio against the peer is the median of
# those paired ratios (``summarize``): per round for the decode rates, per run for the
# first tokens, start-up and memory. Before each server's turn the bench waits until all
# the servers' processes are quiet (``settle``): vLLM-cpu's worker spins on core 0 for
# about a second after its last request, and a worker-mode timeshare server's first token
# right after it took 570-600 ms instead of 15-45 (six tries of each, 2-core VM).
# The long prompts take turns too (``config.longs``): a server's first one is reported
# apart (``ttft_long_first_s``), the median of the others is its new long prompt's time.
def run(config: PeerBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    config.peer_python()  # fail before anything starts
    prompts = Prompts.make(config)
    with tempfile.TemporaryDirectory(prefix="timeshare-peer-") as tmp:
        root = Path(config.workdir) if config.workdir else Path(tmp)
        path = root / f"llama-{config.hidden}-{config.layers}-{config.max_context}"
        if not (path / "config.json").exists():
            progress(f"writing the model directory {path}")
            hfdir.write_model_dir(path, "llama", seed=config.seed, hidden=config.hidden, layers=config.layers,
                                  heads=config.heads, max_positions=config.max_context)
        progress("transformers' greedy text of the decode prompts")
        want = _reference(path, prompts, config.new_tokens)
        servers = [config.peer, *config.modes]
        runs: list[dict] = []
        for r in range(config.runs):
            started_servers: dict[str, Server] = {}
            ready: dict[str, float] = {}
            try:
                for name in _turns(servers, r):  # started one at a time, the order rotated
                    server: Server = VLLMServer(path, config) if name == config.peer else \
                        TimeshareServer(path, name, config)
                    progress(f"run {r + 1}/{config.runs}: starting {server.name}")
                    started = time.monotonic()
                    started_servers[name] = server
                    server.start()
                    first_answer(server.url, prompts.short, config.ready_timeout_s)
                    ready[name] = time.monotonic() - started  # from the start to its first completion
                    progress(f"run {r + 1}/{config.runs}: {server.name} ready in {ready[name]:.1f} s")
                progress(f"run {r + 1}/{config.runs}: requests, the servers taking turns")
                measured = asyncio.run(_measure_async({n: started_servers[n] for n in servers}, prompts, config, r))
                for name in servers:
                    measured[name]["memory_bytes"] = memory_bytes(started_servers[name].pids())
            finally:
                for server in started_servers.values():
                    server.stop()
            row: dict = {}
            peer_texts = measured[config.peer]["texts"]
            for name in servers:
                m = measured[name]
                m["ready_s"] = ready[name]
                texts = m.pop("texts")
                m["greedy_equal_transformers"] = sum(t == w for t, w in zip(texts, want))
                m["greedy_compared"] = len(want)
                if name != config.peer:
                    m["greedy_equal_peer"] = sum(t == p for t, p in zip(texts, peer_texts))
                row[name] = m
            runs.append(row)
    return {"config": asdict(config), "environment": describe(_cpu()), "model": str(path.name),
            "runs": runs, "summary": summarize(runs, servers, config.peer)}


def _cpu():
    import torch

    return torch.device("cpu")


def _reference(path: Path, prompts: Prompts, new_tokens: int) -> list[str]:
    """``transformers``' greedy text after the decode prompts (``Prompts.decoded``), each
    alone, up to its first end-of-sequence token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[str] = []
    for prompt in prompts.decoded:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.inference_mode():
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        end = next((i for i, t in enumerate(got) if t in eos), len(got))
        out.append(str(tok.decode(got[:end])))
    return out


def summarize(runs: list[dict], servers: list[str], peer: str) -> dict:
    """Each server's median and range of every metric over the runs (each run's value of a
    round metric: its rounds' median); and each of ours against the peer, ``paired``: the
    ratio of ours to the peer's next to it (NOTE [Interleaved servers]), round by round
    for ``ROUND_METRICS``, run by run for the others, their median and range;
    ``better_than_peer`` is that median. Times and memory are the peer's over ours: above
    1 is ours better throughout."""
    out: dict = {}
    for name in servers:
        out[name] = {}
        for metric in METRICS:
            values = [r[name][metric] for r in runs]
            out[name][metric] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    for name in servers:
        if name == peer:
            continue
        paired: dict = {}
        for metric in METRICS:
            ratios = [_ratio(metric, ours, theirs) for ours, theirs in _pairs(runs, name, peer, metric)]
            paired[metric] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                              "n": len(ratios)}
        out[name]["paired"] = paired
        out[name]["better_than_peer"] = {metric: p["median"] for metric, p in paired.items()}
    return out


def _pairs(runs: list[dict], name: str, peer: str, metric: str) -> list[tuple[float, float]]:
    """Ours and the peer's ``metric``, measured next to each other: round by round for a
    round metric, run by run for the others."""
    if metric in ROUND_METRICS:
        return [(a[metric], b[metric]) for r in runs for a, b in zip(r[name]["rounds"], r[peer]["rounds"])]
    return [(r[name][metric], r[peer][metric]) for r in runs]


def _ratio(metric: str, ours: float, theirs: float) -> float:
    return theirs / ours if metric in LOWER_IS_BETTER else ours / theirs


# ---------------------------------------------------------------------- plot
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, peer = result["summary"], result["config"]["peer"]
    servers = [peer, *result["config"]["modes"]]
    # The decode rates that hold when a server holds a stream's chunks back (see _measure_async).
    panels = (("decode tokens/s", ("decode_1_tokens_per_s", "e2e_1_tokens_per_s", "e2e_8_decode_tokens_per_s"),
               ("1 request", "1, end\nto end", "8 at once, by\nrequest times")),
              ("first token (ms)", ("ttft_short_s", "ttft_long_first_s", "ttft_long_new_s", "ttft_prefix_s"),
               ("short", "first\nlong", "new\nlong", "cached\nprefix")))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, (title, metrics, labels) in zip(axes[:2], panels):
        width = 0.8 / len(servers)
        for i, name in enumerate(servers):
            scale = 1e3 if "ttft" in metrics[0] else 1.0
            med = [summary[name][m]["median"] * scale for m in metrics]
            low = [med[j] - summary[name][m]["min"] * scale for j, m in enumerate(metrics)]
            high = [summary[name][m]["max"] * scale - med[j] for j, m in enumerate(metrics)]
            ax.bar([j + i * width for j in range(len(metrics))], med, width, yerr=[low, high], capsize=3,
                   label=name if name == peer else f"timeshare {name}")
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(metrics))], labels)
        ax.set_title(title)
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    # The verdict: ours over the peer's next to it (NOTE [Interleaved servers]).
    ratios = (("decode_1_tokens_per_s", "decode,\n1"), ("e2e_8_decode_tokens_per_s", "decode,\n8"),
              ("ttft_long_new_s", "new\nlong"), ("ttft_prefix_s", "cached\nprefix"), ("ready_s", "ready"))
    ours = [m for m in servers if m != peer]
    width = 0.8 / len(ours)
    ax = axes[2]
    for i, name in enumerate(ours):
        paired = summary[name]["paired"]
        med = [paired[m]["median"] for m, _ in ratios]
        low = [med[j] - paired[m]["min"] for j, (m, _) in enumerate(ratios)]
        high = [paired[m]["max"] - med[j] for j, (m, _) in enumerate(ratios)]
        ax.bar([j + i * width for j in range(len(ratios))], med, width, yerr=[low, high], capsize=3,
               label=f"timeshare {name}", color=f"C{i + 1}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(ours) - 1) / 2 for j in range(len(ratios))], [label for _, label in ratios])
    ax.set_yscale("log")
    ax.set_title(f"paired ratio to {peer} (above 1: timeshare better)")
    cfg = result["config"]
    fig.suptitle(f"bench llm --peer {peer}: {cfg['runs']} runs of {cfg['repeats']} interleaved rounds "
                 "(bars: median, whiskers: range)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
