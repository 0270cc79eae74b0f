"""API keys: constant-time comparison, per-key rate limits. The key itself is never logged."""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field

from fastapi import Request

from serving.api.errors import ApiError
from serving.api.settings import ApiKeyEntry, Settings


@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass
class RateLimiter:
    """Token bucket per key id: ``rpm`` requests per minute, bursts up to ``rpm``."""

    buckets: dict[str, _Bucket] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self, key: ApiKeyEntry, now: float | None = None) -> float:
        """0 when allowed, else the seconds until the next request would be."""
        rpm = key.requests_per_minute
        if rpm is None:
            return 0.0
        now = time.monotonic() if now is None else now
        with self.lock:
            bucket = self.buckets.setdefault(key.key_id, _Bucket(tokens=float(rpm), updated=now))
            bucket.tokens = min(float(rpm), bucket.tokens + (now - bucket.updated) * rpm / 60.0)
            bucket.updated = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return 0.0
            return (1.0 - bucket.tokens) * 60.0 / rpm


def find_key(settings: Settings, presented: str) -> ApiKeyEntry | None:
    """Compare against every key (no early exit), each in constant time."""
    match: ApiKeyEntry | None = None
    candidate = presented.encode()
    for entry in settings.api_keys:
        if hmac.compare_digest(entry.secret.encode(), candidate):
            match = entry
    return match


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def authenticate(request: Request) -> ApiKeyEntry | None:
    """The router dependency: 401 without a valid key, 429 over the key's rate limit."""
    state = request.app.state.server
    settings: Settings = state.settings
    guard = getattr(request.app.state, "connections", None)
    if not settings.auth_enabled:
        if guard is not None:
            guard.authenticated(request.scope.get("client"))
        return None
    token = _bearer(request)
    if token is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    entry = find_key(settings, token)
    if entry is None:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    request.scope.setdefault("state", {})["key_id"] = entry.key_id
    if guard is not None:  # this connection may now outlive the cap on unauthenticated connections
        guard.authenticated(request.scope.get("client"))
    wait = request.app.state.rate_limiter.acquire(entry)
    if wait > 0:
        raise ApiError(429, f"rate limit of {entry.requests_per_minute} requests/min exceeded for key "
                       f"{entry.key_id}", code="rate_limit_exceeded", retry_after=wait)
    return entry
