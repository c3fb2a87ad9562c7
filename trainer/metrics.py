"""One metric logger: JSON lines keyed by step, grouped keys (``train/…``, ``perf/…``).

Examples:
    >>> import tempfile, json
    >>> from pathlib import Path
    >>> path = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> with MetricLogger(path) as ml:
    ...     ml.log_config({"lr": 1e-5})
    ...     ml.log(1, {"train/loss": 0.5, "perf/tokens_per_s": 1000.0})
    >>> [json.loads(l) for l in path.read_text().splitlines()][1]
    {'step': 1, 'train/loss': 0.5, 'perf/tokens_per_s': 1000.0}
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["MetricLogger"]


class MetricLogger:
    """Append metrics to ``path`` (rank 0 only: pass ``enabled=False`` elsewhere).

    Args:
        path: JSONL file (appended to, so a resumed run continues the same file).
        enabled: write at all.
    """

    def __init__(self, path: Path, *, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", buffering=1)

    def log_config(self, config: dict[str, Any]) -> None:
        """The full effective configuration, once at start."""
        self._write({"config": config, "time": time.time()})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics (non-finite values are written as null)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._write({"step": step, **clean})

    def _write(self, obj: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(obj, default=str) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
