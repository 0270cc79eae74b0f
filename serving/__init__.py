"""specdeploy serving: the inference engine and its OpenAI-compatible HTTP server."""

__version__ = "0.1.0"
