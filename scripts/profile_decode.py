"""Where a decode step's time goes on a GPU (issues 35, 45): the engine's tokens per second,
the step through the runtime (``ModelTurn.step``) and the runner's step alone, a graph's
replay alone, and profiles of the step (cProfile, torch.profiler). A one-off diagnostic
run on the device machine, in-process:
``PYTHONPATH=src python3 scripts/profile_decode.py [small|1b] [auto|off]`` (the size of
model, and whether the step the graphs capture is compiled). It reads the engine's rows
and the runner from the inside, as no production code may."""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from timeshare.bench import llm_models as models
from timeshare.executor.testing import in_process_worker
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
        batch = m.engine._batch  # the engine's rows, driven from here
        worker = in_process_worker(rt)
        module = worker.models["m"].module
        runner_of = worker.decoders
        seq = Sequence(1, prompt, SamplingParams(max_tokens=500, temperature=0), Detokenizer(m.decode))

        def decode_step(run) -> None:
            batch.short()
            outcome = run(batch.decode())
            batch.stepped()
            seq.tokens.append(outcome.tokens[0])

        with rt.turn("m") as turn:
            row, step = batch.prefill(seq)
            seq.tokens.append(turn.step(step).tokens[0])
            batch.joined(row)
            for _ in range(10):
                decode_step(turn.step)
            t0 = now()
            for _ in range(100):
                decode_step(turn.step)
            print(f"turn.step: {(now() - t0) * 10:.3f} ms a step", flush=True)
            t0 = now()
            for _ in range(100):
                decode_step(lambda st: runner_of.run("m", module, st))
            print(f"the runner's step alone: {(now() - t0) * 10:.3f} ms a step", flush=True)
            runner = runner_of._runners["m"]
            pages = len(batch.rows[0].pages)
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
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                decode_step(turn.step)
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
            print(out.getvalue()[-3000:], flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    decode_step(turn.step)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=16, max_name_column_width=40),
                  flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=40),
                  flush=True)
            kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"about {kernels / 10:.0f} kernels a step", flush=True)
            # The warm prefill (a 64-token prompt, no page of it cached) inside the turn.
            times = []
            for i in range(10):
                s2 = Sequence(2 + i, models.prompt(d, 64, variant=i + 1), SamplingParams(max_tokens=1, temperature=0),
                              Detokenizer(m.decode))
                r2, st = batch.prefill(s2)
                t0 = now()
                turn.step(st)
                times.append(now() - t0)
                batch.abandon(r2)
            print(f"warm prefill: {sorted(times)[5] * 1e3:.2f} ms (median of 10)", flush=True)


if __name__ == "__main__":
    main()
