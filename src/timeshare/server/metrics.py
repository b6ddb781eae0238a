"""Prometheus metrics of a server, in its own registry. Runs in the server's process.

Events (requests, device calls, evictions) are observed as they happen; levels
(queue depth, resident models, memory) and the runtime's counters are read at scrape
time from ``Service.snapshot()``, which never waits for the device. Names follow
Prometheus conventions: ``timeshare_`` prefix, base units (``_seconds``, ``_bytes``),
counters ending in ``_total``, a ``model`` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from timeshare.cluster.snapshots import ClusterView
from timeshare.executor.interface import PoolHealth
from timeshare.llm.sequence import Event, TokenTiming
from timeshare.runtime.events import CallRecord, EvictionRecord
from timeshare.runtime.host_tier import HostTierSnapshot
from timeshare.runtime.observe import RuntimeSnapshot
from timeshare.runtime.sharing import SharingSnapshot
from timeshare.scheduler.lanes import LanesView
from timeshare.server.snapshot import ServiceSnapshot

# 1 ms to 1 min: a resident call on a GPU up to a cold load of a large model on a CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# 0.5 ms to 5 s: one decode step of a batch, up to a step that waited for a switch.
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

disable_created_metrics()  # no *_created series: they double every counter for little use


class Metrics:
    def __init__(self, service):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("timeshare_requests", "Inference requests answered, by HTTP status code",
                                ["model", "code"], registry=r)
        self.request_seconds = Histogram("timeshare_request_duration_seconds",
                                         "From a request's arrival to its response (successful requests)",
                                         ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("timeshare_queue_duration_seconds",
                                       "From a request's arrival until the device ran it", ["model"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("timeshare_batch_size", "Rows per forward, after batching concurrent requests",
                                    ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.load_seconds = Histogram("timeshare_load_duration_seconds",
                                      "Device calls that had to load the model: the pipelined load with the first "
                                      "forward", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.switch_seconds = Histogram("timeshare_switch_duration_seconds",
                                        "Device calls that followed another task on the device (another model or "
                                        "a training job): the switch with the forward", ["model"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.moved = Counter("timeshare_load_bytes", "Bytes copied to the device by loading calls (a model's "
                             "shared tensors already resident are not copied again)", ["model"], registry=r)
        self.switches = Counter("timeshare_switches", "Device calls that followed another task on the device",
                                ["model"], registry=r)
        self.evictions = Counter("timeshare_evictions", "Models removed from device memory", ["model"], registry=r)
        self.failures = Counter("timeshare_failures", "Device calls that raised, by error type",
                                ["model", "error"], registry=r)
        self.rejections = Counter("timeshare_rejected_requests", "Requests refused with 503 because the model's "
                                  "queue was full", ["model"], registry=r)
        # Language models (the OpenAI API): tokens per second is the rate of the tokens counter.
        self.ttft = Histogram("timeshare_llm_time_to_first_token_seconds", "From a generation's arrival to its "
                              "first token", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("timeshare_llm_inter_token_seconds", "Between two tokens of one generation",
                             ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter("timeshare_llm_tokens", "Tokens of finished generations: their prompts and what "
                              "they generated", ["model", "kind"], registry=r)
        self.generations = Counter("timeshare_llm_generations", "Finished generations by how they ended: stop, "
                                   "length, cancelled, error", ["model", "finish_reason"], registry=r)
        r.register(_Levels(service))
        r.register(_Hops(service))
        # Children of labelled metrics by model, for the calls every request makes. A model
        # unloaded and loaded again keeps its series, as prometheus_client's labels() would.
        self._answered: dict[str, tuple[Counter, Histogram]] = {}
        self._queued: dict[str, Histogram] = {}
        self._batched: dict[str, Histogram] = {}

    # ------------------------------------------------------------------ events
    def record(self, rec: CallRecord | EvictionRecord) -> None:
        if isinstance(rec, EvictionRecord):
            self.evictions.labels(rec.model).inc()
            return
        if rec.error is not None:
            self.failures.labels(rec.model, rec.error).inc()
            return
        if rec.loaded:
            self.load_seconds.labels(rec.model).observe(rec.seconds)
            if rec.moved_bytes is not None:
                self.moved.labels(rec.model).inc(rec.moved_bytes)
        if rec.switched:
            self.switches.labels(rec.model).inc()
            self.switch_seconds.labels(rec.model).observe(rec.seconds)

    def answered(self, model: str, code: int, seconds: float | None) -> None:
        if code == 200:  # the children of the common case, looked up once (labels() takes a lock)
            children = self._answered.get(model)
            if children is None:
                children = self._answered[model] = (self.requests.labels(model, "200"),
                                                    self.request_seconds.labels(model))
            children[0].inc()
            if seconds is not None:
                children[1].observe(seconds)
            return
        self.requests.labels(model, str(code)).inc()
        if seconds is not None:
            self.request_seconds.labels(model).observe(seconds)

    def queued(self, model: str, seconds: float) -> None:
        child = self._queued.get(model)
        if child is None:
            child = self._queued[model] = self.queue_seconds.labels(model)
        child.observe(seconds)

    def llm_event(self, event: Event) -> None:
        if isinstance(event, TokenTiming):
            (self.ttft if event.first else self.itl).labels(event.model).observe(event.seconds)
            return
        f = event.finish
        self.tokens.labels(event.model, "prompt").inc(f.prompt_tokens)
        self.tokens.labels(event.model, "completion").inc(f.completion_tokens)
        self.generations.labels(event.model, f.reason).inc()

    def batched(self, model: str, rows: int) -> None:
        child = self._batched.get(model)
        if child is None:
            child = self._batched[model] = self.batch_rows.labels(model)
        child.observe(rows)

    def rejected(self, model: str) -> None:
        self.rejections.labels(model).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Levels:
    """Scrape-time values from ``Service.snapshot()`` (a ``ServiceSnapshot``)."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []  # values exist only once the runtime does

    def collect(self):
        snap = self.service.snapshot()
        rt = snap.runtime
        if rt is None:
            return
        yield from _memory(snap, rt)
        yield from _activity(snap, rt)
        if rt.lanes is not None:  # NOTE [Lanes in the runtime]
            yield from _lanes(rt.lanes)
        if rt.host_tier is not None:  # NOTE [Host tier]
            yield from _host_tier(rt.host_tier)
        if rt.shared is not None:  # NOTE [Shared tensors]
            yield from _shared(rt.shared)
        yield from _language_models(snap)
        if snap.cluster is not None:  # NOTE [A cluster behind the server]
            yield from _cluster(snap.cluster.view)
        if rt.workers is not None:
            yield from _workers(rt.workers)


class _Hops:
    """Scrape-time sums of the answered requests' hops (NOTE [Request hops]): a hop's
    mean over an interval is the rise of its sum over the rise of the count."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    def collect(self):
        count, sums = self.service.hops.snapshot()
        yield CounterMetricFamily("timeshare_request_hops", "Inference requests answered whose hops are counted "
                                  "in timeshare_request_hop_seconds", value=count)
        yield _by_label(CounterMetricFamily, "timeshare_request_hop_seconds", "Seconds answered inference requests "
                        "spent in each hop of the server's path, summed (route, read, parse, check, queue, "
                        "to_thread, prepare, runtime, split, to_loop, encode)", "hop", sums)


def _memory(snap: ServiceSnapshot, rt: RuntimeSnapshot):
    """Levels of memory: queues, the arena and the host stores."""
    yield _by_label(GaugeMetricFamily, "timeshare_queue_depth", "Requests waiting for a model", "model",
                    snap.queue_depth)
    yield _by_label(GaugeMetricFamily, "timeshare_model_resident_bytes", "Device bytes of each resident model",
                    "model", rt.resident)
    yield GaugeMetricFamily("timeshare_resident_models", "Models in device memory", value=len(rt.resident))
    yield GaugeMetricFamily("timeshare_arena_used_bytes", "Device memory of the arena held by resident models and "
                            "reserved regions", value=rt.used_bytes)
    yield _by_label(GaugeMetricFamily, "timeshare_arena_reserved_bytes", "Regions of the arena reserved apart from "
                    "models (key/value pages), by owner", "owner", rt.reserved)
    yield GaugeMetricFamily("timeshare_arena_capacity_bytes", "The device memory budget (the arena): models' "
                            "weights and reserved regions", value=rt.capacity_bytes)
    yield GaugeMetricFamily("timeshare_host_store_bytes", "Host copies of the registered models' weights",
                            value=rt.host_bytes)
    # The bytes registered with CUDA, exactly (NOTE [Exact host pinning]), not a flag per model.
    yield GaugeMetricFamily("timeshare_host_pinned_bytes", "Of those, page-locked (pinned) host memory: the "
                            "bytes registered with the device, exactly", value=rt.host_pinned_bytes)


def _activity(snap: ServiceSnapshot, rt: RuntimeSnapshot):
    """What the device did: loads, preemptions, busy seconds, training iterations."""
    yield _by_label(CounterMetricFamily, "timeshare_model_loads", "Loads of each model onto the device", "model",
                    rt.loads)
    yield CounterMetricFamily("timeshare_preemptions", "Training jobs told to stop at their next "
                              "preemption point for another task", value=rt.preemptions)
    yield _by_label(CounterMetricFamily, "timeshare_device_busy_seconds", "Device time of inference calls and "
                    "of training iterations", "task",
                    {"inference": snap.inference_seconds, "training": rt.training_seconds})
    yield _by_label(CounterMetricFamily, "timeshare_training_iterations", "Iterations done by each training job",
                    "job", snap.jobs)


def _lanes(lanes: LanesView):
    """Salus's memory lanes (scheduling: pack; NOTE [Lanes in the runtime])."""
    yield GaugeMetricFamily("timeshare_lanes", "Memory lanes now (scheduling: pack)", value=len(lanes.lanes))
    yield GaugeMetricFamily("timeshare_lane_capacity_bytes", "The bytes for lanes of ephemeral memory",
                            value=lanes.capacity)
    yield GaugeMetricFamily("timeshare_lane_bytes", "Bytes the lanes now hold (the sum of their sizes)",
                            value=lanes.in_lanes)
    yield GaugeMetricFamily("timeshare_lanes_busy", "Lanes running a task now",
                            value=sum(1 for lane in lanes.lanes if lane.running is not None))
    yield GaugeMetricFamily("timeshare_lane_admissions_waiting", "Tasks waiting for lane memory",
                            value=lanes.waiting_admission)


def _host_tier(host: HostTierSnapshot):
    """Host memory as a cache over disk (NOTE [Host tier])."""
    yield GaugeMetricFamily("timeshare_host_budget_bytes", "The host memory budget for models' host copies",
                            value=host.budget)
    yield GaugeMetricFamily("timeshare_host_stores_in_memory", "Models whose host copy is in memory (the "
                            "others are on disk)", value=host.filled)
    yield CounterMetricFamily("timeshare_host_drops", "Host copies given back to make room (they are read "
                              "from disk again when needed)", value=host.drops)
    yield CounterMetricFamily("timeshare_host_fills", "Host copies read back from disk", value=host.fills)
    yield CounterMetricFamily("timeshare_disk_read_bytes", "Bytes read from weights and spill files",
                              value=host.bytes_read)
    yield CounterMetricFamily("timeshare_disk_read_seconds", "Seconds spent reading them",
                              value=host.read_seconds)


def _shared(shared: SharingSnapshot):
    """Tensors held once for several models (NOTE [Shared tensors])."""
    yield GaugeMetricFamily("timeshare_shared_sets", "Sets of tensors held once for several models",
                            value=shared.sets)
    yield GaugeMetricFamily("timeshare_shared_bytes", "Host bytes of the shared sets",
                            value=shared.shared_bytes)
    yield GaugeMetricFamily("timeshare_shared_resident_bytes", "Device bytes of the shared sets in the arena",
                            value=shared.resident_shared_bytes)
    yield GaugeMetricFamily("timeshare_dedup_saved_bytes", "Host bytes that separate copies of the models "
                            "would take beyond what is held", value=shared.saved_bytes)


def _language_models(snap: ServiceSnapshot):
    """Language models' caches and generations (the OpenAI API)."""
    llms = {name: s.engine for name, s in snap.llms.items() if s.engine is not None}  # the READY ones
    if llms:
        yield _by_label(GaugeMetricFamily, "timeshare_llm_kv_cache_bytes", "Bytes of the key/value caches of "
                        "each language model's running generations", "model",
                        {n: s.kv_bytes for n, s in llms.items()})
        yield _by_label(GaugeMetricFamily, "timeshare_llm_kv_host_bytes", "Of those, the bytes in host memory "
                        "while another task has the device (offload_kv, kv_memory)", "model",
                        {n: s.kv_host_bytes for n, s in llms.items()})
        yield _by_label(CounterMetricFamily, "timeshare_llm_kv_offloads", "Times a model's caches left the "
                        "device for host memory", "model", {n: s.kv_offloads for n, s in llms.items()})
    kv = snap.kv_memory
    if kv is not None:  # NOTE [Key/value caches under pressure]
        yield GaugeMetricFamily("timeshare_llm_kv_memory_bytes", "Bytes the language models' key/value caches "
                                "may keep on the device between their turns (kv_memory)", value=kv.capacity)
        yield GaugeMetricFamily("timeshare_llm_kv_device_bytes", "Bytes of key/value caches on the device now",
                                value=kv.on_device)
        yield CounterMetricFamily("timeshare_llm_kv_pressure_moves", "Times caches moved to host memory to keep "
                                  "those on the device within kv_memory", value=kv.moves)
    if llms:
        yield _by_label(GaugeMetricFamily, "timeshare_llm_running", "Generations decoding together", "model",
                        {n: s.running for n, s in llms.items()})
        yield _by_label(GaugeMetricFamily, "timeshare_llm_waiting", "Generations waiting to start", "model",
                        {n: s.waiting for n, s in llms.items()})
        # NOTE [Prefix caching]: in pages of the model's pool (a page holds a fixed number of positions).
        yield _by_label(CounterMetricFamily, "timeshare_llm_prefix_cache_hits", "Full pages of prompts found "
                        "in the prefix cache (their keys and values not computed again)", "model",
                        {n: s.prefix_hits for n, s in llms.items()})
        yield _by_label(CounterMetricFamily, "timeshare_llm_prefix_cache_misses", "Full pages of prompts not "
                        "found in the prefix cache", "model", {n: s.prefix_misses for n, s in llms.items()})
        adapted = {n: s for n, s in llms.items() if s.adapter_slots}  # NOTE [Adapter residency]
        if adapted:
            yield _by_label(GaugeMetricFamily, "timeshare_llm_adapter_slots", "Device slots for each language "
                            "model's LoRA adapters (max_loras; on a cluster, every replica's)", "model",
                            {n: s.adapter_slots for n, s in adapted.items()})
            yield _by_label(GaugeMetricFamily, "timeshare_llm_adapters_on_device", "Of those, the slots holding "
                            "an adapter", "model", {n: s.adapters_on_device for n, s in adapted.items()})
            yield _by_label(CounterMetricFamily, "timeshare_llm_adapter_loads", "Adapters copied from host memory "
                            "into a slot (a request whose adapter was not on the device)", "model",
                            {n: s.adapter_loads for n, s in adapted.items()})
            yield _by_label(CounterMetricFamily, "timeshare_llm_adapter_load_seconds", "Seconds those copies "
                            "took", "model", {n: s.adapter_load_s for n, s in adapted.items()})
        yield _by_label(CounterMetricFamily, "timeshare_llm_prefill_tokens", "Prompt positions prefills "
                        "computed (those found in the prefix cache were not)", "model",
                        {n: s.prefill_tokens for n, s in llms.items()})
        yield _by_label(GaugeMetricFamily, "timeshare_llm_prefix_cache_pages", "Free pages of the model's pool "
                        "that keep a prefix for later requests (reclaimed first when pages run short)", "model",
                        {n: s.cached_pages for n, s in llms.items()})
        yield _by_label(CounterMetricFamily, "timeshare_llm_preemptions", "Generations put back in the queue "
                        "because the pool had no page for every running one", "model",
                        {n: s.preemptions for n, s in llms.items()})


def _cluster(cluster: ClusterView):
    """The replicas behind the server (NOTE [A cluster behind the server])."""
    yield GaugeMetricFamily("timeshare_cluster_replicas", "Replicas alive", value=cluster.replicas_alive)
    for name, value, doc in (
            ("retried", cluster.retried, "Requests retried on another replica after theirs died"),
            ("failed", cluster.failed, "Requests failed after their retry (or with no replica left)"),
            ("replicas_lost", cluster.replicas_lost, "Replicas that died or stopped answering"),
            ("migrations", cluster.migrations, "Training jobs moved to another replica"),
            ("cpu_fallbacks", cluster.cpu_fallbacks, "Requests run on a replica's CPU instead of its busy device")):
        yield CounterMetricFamily(f"timeshare_cluster_{name}", doc, value=value)
    rows = [r for r in cluster.replicas if r.alive and r.used_bytes is not None]  # those that reported
    yield _by_label(GaugeMetricFamily, "timeshare_replica_used_bytes", "Device memory held by each "
                    "replica's resident models", "replica", {r.replica: r.used_bytes for r in rows})
    yield _by_label(GaugeMetricFamily, "timeshare_replica_outstanding", "Requests in flight on each "
                    "replica", "replica", {r.replica: r.outstanding for r in rows})
    yield _by_label(CounterMetricFamily, "timeshare_replica_loads", "Loads on each replica", "replica",
                    {r.replica: r.loads for r in rows})


def _workers(workers: PoolHealth):
    """The worker pool: its size, readiness and failures."""
    yield GaugeMetricFamily("timeshare_workers", "Worker processes in the pool", value=workers.size)
    yield GaugeMetricFamily("timeshare_workers_ready", "Workers started and ready to serve",
                            value=workers.ready)
    yield CounterMetricFamily("timeshare_worker_replacements", "Workers replaced after a crash or a hang",
                              value=workers.replacements)
    yield _by_label(CounterMetricFamily, "timeshare_worker_failures", "Replaced workers by what went wrong: "
                    "died starting, hung past a call's deadline, crashed, or broke the protocol", "kind",
                    workers.failures)
    yield GaugeMetricFamily("timeshare_workers_failing_to_start", "Replacements in a row that died before "
                            "they were ready (the pool backs off between them)",
                            value=workers.failing_to_start)


def _by_label(family, name: str, documentation: str, label: str, values: dict):
    metric = family(name, documentation, labels=[label])
    for key, value in values.items():
        metric.add_metric([key], value)
    return metric
