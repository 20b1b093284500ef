"""Load patterns: closed-loop clients (the paper's) and open-loop Poisson arrivals (vLLM's).

A closed loop of N clients starts N requests at once; each client sends its next request the
moment its previous one ends, with no think time, until the run's requests are spent. Poisson
arrivals come at exponential intervals of mean ``1 / rate`` whatever the server is doing.
Every run is bounded by a number of requests and by a wall-clock limit (:class:`RunLimits`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ClosedLoop:
    num_clients: int

    def __post_init__(self) -> None:
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {self.num_clients}")

    @property
    def label(self) -> str:
        return f"{self.num_clients} client{'s' if self.num_clients > 1 else ''}"


@dataclass(frozen=True)
class Poisson:
    rate_per_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {self.rate_per_s}")

    @property
    def label(self) -> str:
        return f"poisson {self.rate_per_s:g}/s"

    def arrival_times_s(self, num_requests: int) -> list[float]:
        """When each request is sent, from the start of the run: the first at 0, then
        exponential gaps of mean ``1 / rate`` (seeded, so every policy sees the same arrivals)."""
        rng = random.Random(f"fastgen-bench/poisson/{self.seed}/{self.rate_per_s!r}")
        times, t = [], 0.0
        for i in range(num_requests):
            if i:
                t += rng.expovariate(self.rate_per_s)
            times.append(t)
        return times


Load = ClosedLoop | Poisson


@dataclass(frozen=True)
class RunLimits:
    """Bounds of one load point: at most ``num_requests`` requests and ``max_duration_s`` seconds
    (requests still running then are cut off and reported as such)."""

    num_requests: int
    max_duration_s: float

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not self.max_duration_s > 0:
            raise ValueError(f"limits must be positive: {self}")


def load_to_json(load: Load) -> dict:
    if isinstance(load, ClosedLoop):
        return {"kind": "closed", "num_clients": load.num_clients}
    return {"kind": "poisson", "rate_per_s": load.rate_per_s, "seed": load.seed}


def load_from_json(d: dict) -> Load:
    if d["kind"] == "closed":
        return ClosedLoop(d["num_clients"])
    return Poisson(d["rate_per_s"], d.get("seed", 0))
