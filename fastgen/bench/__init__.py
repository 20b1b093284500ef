"""Benchmarks: ``fastgen.bench.engine`` (one forward pass against the machine's limits) and the
serving benchmark of the paper (``fastgen bench``: workloads, load, effective throughput, plots)."""
from __future__ import annotations

from typing import Sequence


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``fastgen bench [options]`` / ``fastgen bench report ...``; returns the exit status."""
    from .cli import main  # imported here so that `import fastgen.bench.engine` stays light

    return main(argv)
