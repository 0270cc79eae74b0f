"""Benchmarks and their harness: what `specdeploy bench ...`, `make gpu-check` and the `python -m infra.bench.*`
scripts measure.

Unlike the rest of infra/, these modules import torch and the engine at module level; the CLI reaches them
only inside the `bench` command's functions. Nothing here is imported by the server or shipped in its image.
"""
