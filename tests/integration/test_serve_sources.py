"""`timeshare serve MODEL` with no config file (issue 34): a Hugging Face model directory it
has never seen, and a repository id in a Hugging Face cache layout, served behind the
OpenAI API; the official client's greedy text equals transformers' ``generate``; `timeshare
ps` lists the resident language model with its bytes; the banner names it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from timeshare.config.sources import from_cache, section
from timeshare.config.workloads import LLMConfig, ModelConfig
from timeshare.errors import ConfigError
from timeshare.llm import hfdir

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Served:
    """``timeshare serve ARGS`` in a process of its own, until it is ready."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "timeshare", "serve", *args, "--port", str(self.port), "--host", "127.0.0.1",
                 "--metrics-port", "none", "--device", "cpu", "--memory", "64MiB"],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(time.monotonic() + 180)
        except BaseException:
            self.proc.kill()  # a server that never got ready leaves nothing behind
            self.proc.wait(60)
            raise

    def _wait_ready(self, deadline: float) -> None:
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"not ready in 180 s: {self.log.read_text()[-2000:]}"
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def _greedy(path: Path, prompt: str, n: int) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    model = hfdir.write_model_dir(root / "my-llama", "llama", seed=5, hidden=64, layers=2)
    # The same files in a Hugging Face hub cache's layout: refs/main names a snapshot.
    repo = root / "hub" / "models--acme--tiny-llama"
    shutil.copytree(model, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return model, root / "hub"


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_CACHE"] = str(cache)
    env.pop("HF_HUB_OFFLINE", None)  # offline by construction: nothing may be fetched anyway
    return env


def test_serve_models_without_a_config_and_see_them_in_ps(places, tmp_path):
    """A model directory and a repository in the Hugging Face cache, served by one server."""
    model, cache = places
    names = ["my-llama", "acme/tiny-llama"]  # the directory's name, the repository's id
    served = _Served([str(model), "acme/tiny-llama"], _env(cache), tmp_path / "server.log")
    try:
        want = _greedy(model, "serve what you have", 12)
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            assert sorted(m.id for m in client.models.list().data) == sorted(names)
            for name in names:
                out = client.completions.create(model=name, prompt="serve what you have", max_tokens=12,
                                                temperature=0)
                assert out.choices[0].text == want, name
        ps = subprocess.run([sys.executable, "-m", "timeshare", "ps", "--url", served.url, "--json"],
                            capture_output=True, text=True, timeout=60)
        assert ps.returncode == 0, ps.stderr
        rows = {r["name"]: r for r in json.loads(ps.stdout)}
        weights = sum(t.numel() * t.element_size() for t in hfdir.read_weights(model).values())
        for name in names:
            row = rows[name]
            assert row["kind"] == "language model" and row["state"] == "READY"
            assert row["device_bytes"] is not None and row["device_bytes"] >= weights  # resident, all of it
            assert row["last_used_s"] is not None and row["last_used_s"] < 600
        table = subprocess.run([sys.executable, "-m", "timeshare", "ps", "--url", served.url],
                               capture_output=True, text=True, timeout=60)
        assert table.returncode == 0 and all(n in table.stdout for n in names) and "READY" in table.stdout
    finally:
        code = served.stop()
    assert code == 0
    banner = (tmp_path / "server.log").read_text()
    assert "0 models, 0 training jobs, 2 language models" in banner and all(n in banner for n in names)
    for i, name in enumerate(names, 1):
        assert f"loading language model {i} of 2: {name}" in banner  # start-up's progress


def test_what_cannot_be_served_is_named(places, tmp_path):
    model, cache = places
    with pytest.raises(ConfigError, match="neither a file, a directory nor a repository"):
        section("acme/absent", cache=cache)
    assert from_cache("acme/absent", cache) is None
    encoder = hfdir.write_model_dir(tmp_path / "bert", "bert", seed=1)
    got = section(str(encoder))  # an encoder: the Open Inference Protocol (and /v1/embeddings)
    assert isinstance(got, ModelConfig) and got.path == str(encoder.resolve()) and got.name == "bert"
    assert [i.name for i in got.inputs or []] == ["input_ids", "attention_mask"]
    assert section(str(encoder), name="acme--bert").name == "acme--bert"
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ConfigError, match="needs --build"):
        section(str(weights))
    got = section(str(model), name="acme/served")
    assert got == LLMConfig(name="acme/served", path=str(model.resolve()))
    with pytest.raises(ValueError, match="one '/' at most"):
        LLMConfig(name="a/b/c", path=str(model))


def test_version_is_printed():
    out = subprocess.run([sys.executable, "-m", "timeshare", "--version"], capture_output=True, text=True,
                         timeout=60)
    from timeshare import __version__

    assert out.returncode == 0 and out.stdout.strip() == f"timeshare {__version__}"
