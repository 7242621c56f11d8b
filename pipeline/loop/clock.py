"""Where a generation's time goes: seconds spent in model compute and in contract scoring.

The steps add to ``CLOCK`` around the work itself (decoding, the optimisation loop, running scorers),
so ``bench/overhead.py`` can report what is left: orchestration (Prefect), registry, MLflow and I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class ComputeClock:
    """Accumulated seconds per kind of work (thread-safe)."""

    by_kind: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + seconds

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - started)

    def total(self, *kinds: str) -> float:
        return sum(v for k, v in self.by_kind.items() if not kinds or k in kinds)

    def reset(self) -> None:
        with self._lock:
            self.by_kind.clear()


CLOCK = ComputeClock()
