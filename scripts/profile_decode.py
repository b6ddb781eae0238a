"""Where a decode step's time goes on a GPU (issue 35): the engine's tokens per second,
the caches' step alone, a graph's replay alone, an empty runtime call, and profiles of
the step (cProfile, torch.profiler). A one-off diagnostic run on the device machine:
``PYTHONPATH=src python3 scripts/profile_decode.py [small|1b] [auto|off]`` (the size of
model, and whether the step the graphs capture is compiled)."""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from timeshare.bench import llm_models as models
from timeshare.llm import model as lm
from timeshare.llm.sampling import SamplingParams
from timeshare.llm.sequence import Detokenizer, Sequence
from timeshare.runtime.facade import Runtime


def now() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    size = sys.argv[1] if len(sys.argv) > 1 else "small"
    compile = sys.argv[2] if len(sys.argv) > 2 else "auto"
    dev = torch.device("cuda")
    d = models.write(Path("/tmp/prof-models"), "llama", size, 0, seed=0, max_positions=512, device=dev)
    prompt = models.prompt(d, 64)
    with Runtime(dev, "auto") as rt:
        t0 = time.perf_counter()
        m = lm.load(rt, "m", d, dtype="bf16", max_sequences=32, compile=compile)
        snap = m.engine.snapshot()
        print(f"{size}, compile {compile}: registered in {time.perf_counter() - t0:.1f} s; {snap.graph_captures} "
              f"graphs ({snap.graphs_compiled} compiled) in {snap.capture_s:.1f} s", flush=True)
        p = SamplingParams(max_tokens=64, temperature=0)
        for _ in range(2):
            m.generate(prompt, p).result(60)
        s = m.generate(prompt, p)
        s.result(60)
        print(f"engine: {(s.last_token_at - s.first_token_at) / 63 * 1e3:.3f} ms a token", flush=True)
        m.engine.close()
        caches = m.engine._caches
        runner = caches.runner
        seq = Sequence(1, prompt, SamplingParams(max_tokens=500, temperature=0), Detokenizer(m.decode))
        with rt.turn("m") as turn:
            seq.tokens.append(caches.prefill(turn, seq))
            for _ in range(10):
                seq.tokens.append(caches.decode(turn, [seq])[0])
            t0 = now()
            for _ in range(100):
                seq.tokens.append(caches.decode(turn, [seq])[0])
            print(f"caches.decode: {(now() - t0) * 10:.3f} ms a step", flush=True)
            pages = len(runner.rows[0].pages)
            g = runner._graphs[(runner._batches[0],
                                max(runner._contexts[0], min(1 << max(0, (pages - 1).bit_length()), runner._width)))]
            t0 = now()
            for _ in range(100):
                g.replay()
            print(f"replay, synced once: {(now() - t0) * 10:.3f} ms", flush=True)
            t0 = time.perf_counter()
            for _ in range(100):
                g.replay()
                torch.cuda.synchronize()
            print(f"replay + sync: {(time.perf_counter() - t0) * 10:.3f} ms", flush=True)
            t0 = time.perf_counter()
            for _ in range(100):
                turn.call((), {"paged": lambda mod: torch.zeros(1, dtype=torch.long)})
            print(f"empty turn.call: {(time.perf_counter() - t0) * 10:.3f} ms", flush=True)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                seq.tokens.append(caches.decode(turn, [seq])[0])
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
            print(out.getvalue()[-3000:], flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    seq.tokens.append(caches.decode(turn, [seq])[0])
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=16, max_name_column_width=40),
                  flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=40),
                  flush=True)
            kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"about {kernels / 10:.0f} kernels a step", flush=True)
            # The warm prefill (a 64-token prompt) inside the turn, as the engine runs it.
            times = []
            for _ in range(10):
                s2 = Sequence(2, prompt, SamplingParams(max_tokens=1, temperature=0), Detokenizer(m.decode))
                t0 = now()
                caches.prefill(turn, s2)
                times.append(now() - t0)
                runner.keep(list(range(len(runner) - 1)))
            print(f"warm prefill: {sorted(times)[5] * 1e3:.2f} ms (median of 10)", flush=True)


if __name__ == "__main__":
    main()
