"""Alarm targets and thresholds, and the SLO targets the launch validation judges against."""

from __future__ import annotations

from pydantic import Field, field_validator

from serving.config import StrictModel


class AlertingSpec(StrictModel):
    emails: list[str] = Field(default_factory=list, description="Email addresses subscribed to alerts.")
    https_endpoints: list[str] = Field(default_factory=list, description="HTTPS webhooks (pager, chat).")
    runbook_base_url: str = Field(
        "https://github.com/specdeploy/specdeploy/blob/main/runbooks",
        description="Base URL of runbooks/; each alarm links <base>/<AlarmName>.md.",
    )
    gpu_memory_warn_ratio: float = Field(0.85, gt=0, le=1, description="GPU memory share that warns (guide).")
    gpu_utilization_high_ratio: float = Field(0.95, gt=0, le=1, description="Sustained GPU busy share.")
    error_rate_critical: float = Field(0.01, gt=0, le=1, description="5xx share that pages (guide: 1 %).")
    p99_latency_s: float = Field(30.0, gt=0, description="P99 end-to-end latency threshold.")
    p99_ttft_s: float = Field(2.0, gt=0, description="P99 time-to-first-token threshold.")
    queue_length_warn: int = Field(32, ge=1, description="Waiting requests per instance that warn.")
    evaluation_minutes: int = Field(5, ge=1, le=60, description="Minutes a condition must hold.")

    @field_validator("https_endpoints")
    @classmethod
    def _https(cls, values: list[str]) -> list[str]:
        for value in values:
            if not value.startswith("https://"):
                raise ValueError(f"{value!r} must be an https:// URL")
        return values


class SloSpec(StrictModel):
    """Targets the launch verdict judges against (the guide: compare every figure with a target)."""

    ttft_p99_ms: float = Field(2000, gt=0, description="P99 time to first token.")
    tpot_p99_ms: float = Field(200, gt=0, description="P99 time per output token after the first.")
    e2e_p99_s: float = Field(30, gt=0, description="P99 end-to-end latency.")
    min_tokens_per_s: float = Field(0, ge=0, description="Aggregate generated tokens/s at target load.")
    max_error_rate: float = Field(0.0, ge=0, le=1, description="Error share allowed under target load.")
    target_concurrency: int = Field(8, ge=1, description="Concurrency at which the SLOs must hold.")
    memory_slope_mb_per_min: float = Field(5.0, gt=0, description="Soak: RSS growth above this is a leak.")
