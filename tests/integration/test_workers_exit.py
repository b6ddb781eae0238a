"""NOTE [Workers at exit]: a script that leaves a runtime with workers open (an exception,
a closed stdout) exits at once, replacing no worker and leaving nothing behind."""

import os
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import os, sys
    from timeshare.runtime.facade import Runtime
    from timeshare.models.zoo import get, weights_path

    def main():
        zoo = get("tiny_mlp")
        inputs = zoo.example_inputs(1)
        rt = Runtime("cpu", "64MiB", workers=2)  # never closed
        rt.register("m", zoo.builder, weights_path("tiny_mlp"), inputs)
        rt.infer("m", *inputs)
        print("pids", *rt.worker_pids(), flush=True)
        with open("/proc/self/maps") as f:
            mapped = {line.split()[5].removeprefix("/dev/shm/") for line in f
                      if len(line.split()) >= 6 and line.split()[5].startswith("/dev/shm/")}
        print("segments", *sorted(mapped), flush=True)
        raise SystemExit(3)

    if __name__ == "__main__":
        main()
""")


def test_a_runtime_left_open_at_exit_stops_its_workers_and_replaces_none(tmp_path):
    script = tmp_path / "left_open.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert time.monotonic() - t0 < 60
    assert done.returncode == 3, done.stderr
    assert "replaced" not in done.stderr and "process object is closed" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    lines = dict((line.split()[0], line.split()[1:]) for line in done.stdout.splitlines())
    pids = [int(p) for p in lines["pids"]]
    assert len(pids) == 2 and lines["segments"]  # the arena and the workers' channels
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in lines["segments"])
