"""Names of every Prometheus series the server exports.

The alert rules (infra/alerts.py), the Grafana dashboard and the launch
validation query these names; a test cross-checks them against the /metrics
page of a running server, so a rename here breaks loudly everywhere.
"""

PREFIX = "specdeploy"

# Counters (exported with a `_total` suffix by prometheus-client).
REQUESTS = f"{PREFIX}_requests"  # labels: endpoint, status (HTTP code)
PROMPT_TOKENS = f"{PREFIX}_prompt_tokens"
GENERATION_TOKENS = f"{PREFIX}_generation_tokens"
PREEMPTIONS = f"{PREFIX}_preemptions"
STEP_FAILURES = f"{PREFIX}_engine_step_failures"  # steps that raised; their requests failed, the engine went on
SPEC_DRAFTS = f"{PREFIX}_spec_drafts"  # verify steps that carried at least one draft token
SPEC_DRAFT_TOKENS = f"{PREFIX}_spec_draft_tokens"
SPEC_ACCEPTED_TOKENS = f"{PREFIX}_spec_accepted_tokens"
# the adaptive guard's decoding steps (zero with a fixed k): all it decided; of them, those run without drafts because
# drafting measured slower at that load, and those run without drafts to measure plain decoding; and the times a
# load turned speculation off
SPEC_GUARD_CYCLES = f"{PREFIX}_spec_guard_cycles"
SPEC_GUARD_VETOED_CYCLES = f"{PREFIX}_spec_guard_vetoed_cycles"
SPEC_GUARD_PLAIN_CYCLES = f"{PREFIX}_spec_guard_plain_cycles"
SPEC_GUARD_VETOES = f"{PREFIX}_spec_guard_vetoes"
PREFIX_CACHE_QUERIES = f"{PREFIX}_prefix_cache_queries"  # prompt tokens looked up; hit rate = hits / queries
PREFIX_CACHE_HITS = f"{PREFIX}_prefix_cache_hits"  # of which found in the prefix cache

# Histograms (seconds).
TTFT = f"{PREFIX}_time_to_first_token_seconds"
TPOT = f"{PREFIX}_time_per_output_token_seconds"
INTER_TOKEN = f"{PREFIX}_inter_token_latency_seconds"
E2E = f"{PREFIX}_e2e_request_latency_seconds"
QUEUE_TIME = f"{PREFIX}_request_queue_time_seconds"
STEP_TIME = f"{PREFIX}_engine_step_seconds"

# Gauges.
RUNNING = f"{PREFIX}_requests_running"
WAITING = f"{PREFIX}_requests_waiting"
KV_BLOCKS_USED = f"{PREFIX}_kv_blocks_used"
KV_BLOCKS_TOTAL = f"{PREFIX}_kv_blocks_total"
READY = f"{PREFIX}_ready"
RSS_BYTES = f"{PREFIX}_process_resident_memory_bytes"
GPU_MEMORY_USED = f"{PREFIX}_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL = f"{PREFIX}_gpu_memory_total_bytes"
GPU_UTILIZATION = f"{PREFIX}_gpu_utilization_ratio"
