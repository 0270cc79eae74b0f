"""The engine tests' tiny checkpoints and engine helpers, for the benchmarks that drive an engine."""

from tests.serving.engine.conftest import kit, llama_dir, one_torch_thread, qwen2_dir

__all__ = ["kit", "llama_dir", "one_torch_thread", "qwen2_dir"]
