"""The OpenAI-compatible HTTP API: one router per concern under ``routes/``."""
