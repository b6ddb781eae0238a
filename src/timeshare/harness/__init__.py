"""Harness for benches, the demo and tests: a ``timeshare serve`` in a child process
(``process.py``) and an Open Inference Protocol client for it (``client.py``). Not part of
the server: it speaks only the server's wire format."""
