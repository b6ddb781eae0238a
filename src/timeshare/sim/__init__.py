"""The trace-driven simulator: cost model, traces, model cache, the discrete-event engine that runs the real \
scheduler, several devices behind a dispatcher, and the studies (Salus's Table 1 and its calibration, many-model \
serving). Runs in the CLI's process."""
