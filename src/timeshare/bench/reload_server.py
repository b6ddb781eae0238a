"""The baseline of ``timeshare bench llm``'s fleet: an OpenAI-style completions server that
holds one language model at a time and, for a request to another, unloads it and loads
the requested one (``from_pretrained`` onto the device), as llama-swap does with whole
server processes. Requests run one at a time, in arrival order; tokens stream as they
are decoded (a prefill, then one step per token with ``transformers``' own cache).

Run as ``python -m timeshare.bench.reload_server CONFIG.json`` (the bench starts it as a
child process); CONFIG: ``{"port": P, "device": "cpu", "dtype": "fp32", "models": {name:
directory}}``. Not part of timeshare's server: a yardstick."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from timeshare.dtypes import parse_dtype

REQUEST_TIMEOUT_S = 900.0  # the longest a request waits for its turn, or for its next token


class Reloader:
    def __init__(self, models: dict[str, str], device: str, dtype: torch.dtype | None):
        from transformers import AutoTokenizer

        self.models, self.device, self.dtype = models, torch.device(device), dtype
        self.tokenizers = {n: AutoTokenizer.from_pretrained(p) for n, p in models.items()}
        self.loaded: tuple[str, torch.nn.Module] | None = None
        self.lock = threading.Lock()
        self.loads = 0
        self.load_seconds = 0.0

    def model(self, name: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if self.loaded is not None and self.loaded[0] == name:
            return self.loaded[1]
        t0 = time.perf_counter()
        self.loaded = None  # unload first: the device holds one model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        module: Any = AutoModelForCausalLM.from_pretrained(self.models[name], dtype=self.dtype)
        module = module.to(self.device).eval()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.loaded = (name, module)
        self.loads += 1
        self.load_seconds += time.perf_counter() - t0
        return module

    def generate(self, name: str, prompt: str, max_tokens: int, emit) -> tuple[int, int]:
        """Greedy tokens of ``prompt``, each given to ``emit(text)`` as decoded, once the
        requests before it are done; returns the prompt's and the completion's token
        counts."""
        if not self.lock.acquire(timeout=REQUEST_TIMEOUT_S):
            raise TimeoutError(f"no turn within {REQUEST_TIMEOUT_S:g} s")
        try:
            return self._generate(name, prompt, max_tokens, emit)
        finally:
            self.lock.release()

    def _generate(self, name: str, prompt: str, max_tokens: int, emit) -> tuple[int, int]:
        from transformers import DynamicCache

        from timeshare.decode.cache import cache_key

        tok = self.tokenizers[name]
        with torch.no_grad():
            module: Any = self.model(name)
            ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]], device=self.device)
            cache = DynamicCache(config=module.config)
            out = module(ids, attention_mask=torch.ones_like(ids), **{cache_key(): cache}, use_cache=True,
                         logits_to_keep=1)
            tokens: list[int] = []
            sent = ""
            eos = tok.eos_token_id
            for _ in range(max_tokens):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                text = str(tok.decode(tokens, skip_special_tokens=True))
                if not text.endswith("\ufffd") and len(text) > len(sent):
                    emit(text[len(sent):])
                    sent = text
                if token == eos or len(tokens) == max_tokens:
                    break
                n = ids.shape[1] + len(tokens)
                out = module(torch.tensor([[token]], device=self.device), **{cache_key(): cache}, use_cache=True,
                             attention_mask=torch.ones(1, n, dtype=torch.long, device=self.device),
                             position_ids=torch.tensor([[n - 1]], device=self.device), logits_to_keep=1)
            text = str(tok.decode(tokens, skip_special_tokens=True))
            if len(text) > len(sent):
                emit(text[len(sent):])
            return ids.shape[1], len(tokens)


def create_app(reloader: Reloader):
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"loads": reloader.loads, "load_seconds": reloader.load_seconds}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        name = body.get("model")
        if name not in reloader.models:
            return JSONResponse({"error": {"message": f"no model {name!r}", "type": "invalid_request_error",
                                           "param": "model", "code": "model_not_found"}}, status_code=404)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(text: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("text", text))

        def work() -> None:
            try:
                counts = reloader.generate(name, body["prompt"], int(body.get("max_tokens", 16)), emit)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", counts))
            except Exception as exc:  # a yardstick's error, shown to the bench
                loop.call_soon_threadsafe(queue.put_nowait, ("error", repr(exc)))

        threading.Thread(target=work, daemon=True).start()

        async def events():
            while True:
                try:
                    kind, value = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
                except TimeoutError:
                    kind, value = "error", f"no token in {REQUEST_TIMEOUT_S:g} s"
                if kind == "text":
                    chunk = {"object": "text_completion", "model": name,
                             "choices": [{"index": 0, "text": value, "finish_reason": None}]}
                elif kind == "done":
                    chunk = {"object": "text_completion", "model": name, "choices": [],
                             "usage": {"prompt_tokens": value[0], "completion_tokens": value[1],
                                       "total_tokens": value[0] + value[1]}}
                else:
                    chunk = {"error": {"message": value, "type": "server_error"}}
                yield f"data: {json.dumps(chunk)}\n\n"
                if kind != "text":
                    yield "data: [DONE]\n\n"
                    return

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    config = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    dtype = parse_dtype(config["dtype"]) if config.get("dtype") else None
    reloader = Reloader(config["models"], config.get("device", "cpu"), dtype)
    uvicorn.run(create_app(reloader), host="127.0.0.1", port=int(config["port"]), log_level="warning")


if __name__ == "__main__":
    main()
