"""Where a local stack's server lives on this machine: its state directory and its container's name.

Relative paths in the stack file (state_dir, file:// URIs) are relative to the repository checkout,
i.e. the parent of the stacks directory. The local platform (infra/ops/local.py) writes here; the
launch checks read the API key and the container's name from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infra.config import StackFile


@dataclass(frozen=True)
class LocalPaths:
    state_dir: Path

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "server.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "server.log"

    @property
    def server_config(self) -> Path:
        return self.state_dir / "server.yaml"

    @property
    def api_keys_file(self) -> Path:
        return self.state_dir / "api_keys"

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    def api_key(self) -> str | None:
        """The first key in the key file, None when there is none."""
        try:
            first = self.api_keys_file.read_text().splitlines()[0]
        except (OSError, IndexError):
            return None
        return first.split(":")[1] if ":" in first else None


def checkout_of(stack: StackFile) -> Path:
    """The repository checkout a stack file belongs to: the parent of its stacks directory."""
    return stack.path.resolve().parent.parent


def local_path(stack: StackFile, value: str) -> Path:
    """A path from the stack file, relative ones taken from the checkout."""
    path = Path(value)
    return path if path.is_absolute() else checkout_of(stack) / path


def local_paths(stack: StackFile) -> LocalPaths:
    return LocalPaths(local_path(stack, stack.config.local.state_dir))


def container_name(stack: StackFile) -> str:
    """The local container runtime's container for ``stack``."""
    return f"specdeploy-{stack.name}"
