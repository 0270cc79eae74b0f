"""Servers on this machine: a `specdeploy serve` process (process.py) or the server image under
podman (container.py, podman.py), and where a local stack keeps them (state.py).

The local platform (infra/ops/local.py), the launch checks (infra/validation) and the benchmarks
start, wait for and drain servers through this package alone.
"""
