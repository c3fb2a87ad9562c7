"""A SIGTERM that lands while the trainer publishes and checkpoints takes effect after both (trainer/recipes/rl.py).

The loop's lifeline SIGTERMs the trainer the moment the loop dies, which in the kill -9 test is right after a
version appears: stopped between the publish and the checkpoint, the trainer resumed from the previous
checkpoint and gave its next version the wrong parent. Run in its own interpreter (a real SIGTERM, the
default disposition put back).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, signal
from trainer.recipes.rl import _stop_signals_deferred

with _stop_signals_deferred():
    os.kill(os.getpid(), signal.SIGTERM)
    print("published", flush=True)
    print("checkpointed", flush=True)
print("trained on", flush=True)
"""


def test_sigterm_in_publish_and_checkpoint_ends_the_trainer_after_both() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout.splitlines() == ["published", "checkpointed"], proc.stdout
