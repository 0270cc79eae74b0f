"""The server's one ``Settings`` object: the config file plus what only the environment may hold.

API keys come from an environment variable or a file mounted from a secret store, never from the
config file: ``id:key[:requests_per_minute]``, comma separated (env) or one per line (file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from serving.config import ConfigError, ServerConfig, load_server_config

ENV_VAR = "SPECDEPLOY_ENV"
CONFIG_ENV_VAR = "SPECDEPLOY_CONFIG"
Environment = Literal["development", "production"]

# Keys that are obviously examples; refused outside development.
_PLACEHOLDER_KEYS = frozenset({"changeme", "change-me", "secret", "test", "example", "placeholder", "sk-xxx"})
_MIN_KEY_LENGTH = 16


@dataclass(frozen=True)
class ApiKeyEntry:
    key_id: str  # what logs and metrics may show
    secret: str = field(repr=False)  # never logged, never in an error message
    requests_per_minute: int | None = None  # None = unlimited


@dataclass(frozen=True)
class Settings:
    config: ServerConfig
    api_keys: tuple[ApiKeyEntry, ...] = ()
    environment: Environment = "production"

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def model_name(self) -> str:
        return self.config.service.served_model_name

    @classmethod
    def from_config(cls, config: ServerConfig, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        environment = environ.get(ENV_VAR, "production")
        if environment not in ("development", "production"):
            raise ConfigError(f"{ENV_VAR}: must be 'development' or 'production', got {environment!r}")
        keys = load_api_keys(config, environ)
        if environment != "development":
            if not keys:
                raise ConfigError(
                    f"no API keys: set {config.service.api_keys_env} or service.api_keys_file "
                    f"(or {ENV_VAR}=development to run without auth)"
                )
            weak = [k.key_id for k in keys if k.secret.lower() in _PLACEHOLDER_KEYS or len(k.secret) < _MIN_KEY_LENGTH]
            if weak:
                raise ConfigError(
                    f"API key(s) {', '.join(weak)}: placeholder or shorter than {_MIN_KEY_LENGTH} characters"
                )
        return cls(config=config, api_keys=keys, environment=environment)  # type: ignore[arg-type]

    @classmethod
    def from_file(cls, path: str | Path, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        return cls.from_config(load_server_config(path, environ), environ)


def parse_api_keys(text: str, source: str) -> list[ApiKeyEntry]:
    """Entries ``id:key[:rpm]`` separated by commas or newlines; ``#`` starts a comment line."""
    entries: list[ApiKeyEntry] = []
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    items = [item.strip() for line in lines for item in line.split(",")]
    for index, item in enumerate(i for i in items if i):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            # The entry itself may be a secret: name its position, not its text.
            raise ConfigError(f"{source}: entry {index + 1} is not `id:key[:requests_per_minute]`")
        rpm: int | None = None
        if len(parts) == 3:
            if not parts[2].isdigit() or int(parts[2]) < 1:
                raise ConfigError(f"{source}: key {parts[0]}: requests_per_minute must be a positive integer")
            rpm = int(parts[2])
        entries.append(ApiKeyEntry(key_id=parts[0], secret=parts[1], requests_per_minute=rpm))
    return entries


def load_api_keys(config: ServerConfig, environ: Mapping[str, str]) -> tuple[ApiKeyEntry, ...]:
    keys: list[ApiKeyEntry] = []
    env_name = config.service.api_keys_env
    if environ.get(env_name):
        keys += parse_api_keys(environ[env_name], f"${env_name}")
    if config.service.api_keys_file:
        path = Path(config.service.api_keys_file)
        try:
            keys += parse_api_keys(path.read_text(encoding="utf-8"), str(path))
        except FileNotFoundError as exc:
            raise ConfigError(f"service.api_keys_file: {path} does not exist") from exc
    ids = [k.key_id for k in keys]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"API key id {duplicate} is defined twice")
    return tuple(keys)
