"""The trace-driven simulator: cost model, traces, model cache and the discrete-event engine that runs the real \
scheduler. Runs in the CLI's process."""
