"""The GRPO direction test (docs/trainer.md, "Warm start and online GRPO"): offline steps on one version's samples.

From a policy (``--model``, the version that acted) and a loop run's dataset (``--data``), each variant
(``--variants``: JSON ``{"name": {config overrides over trainer/configs/grpo-loop.yaml}}``) trains offline GRPO
steps on that version's samples only (``max_staleness: 0``) and publishes the result; then each result is

* re-scored on those samples: the mean log-prob of positive- and negative-advantage tokens and the surrogate
  ``sum A * log pi`` (it must rise: the gradient's sign), and
* evaluated like ``bench/learning.py``: sampled pass@1 on 24 held-out tasks per domain x level (seed 7).

    python -m bench.grpo_direction --data runs/loop-learning/data --model runs/bc/policies/v1 \\
        --out /tmp/direction --variants '{"H": {"max_steps": 12, "data": {"batch_size": 16}, "optim": {"lr": 1e-4}}}'

Prints one line per variant, and ``--model``'s own line first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def score(data: Path, model: Path, version: int) -> dict:
    """Mean log-prob of the version's positive/negative-advantage tokens under ``model``, and ``sum A log pi``."""
    from trainer.audit import _scored_batches
    from trainer.data import StepFilter, TrajectoryStream

    stream = TrajectoryStream(data, seq_len=2048, batch_size=8, advantage_field="group_advantage", shuffle=False,
                              max_epochs=1, filters=StepFilter(min_policy_version=version, max_policy_version=version))
    s = {"pos": 0.0, "neg": 0.0, "npos": 0, "nneg": 0, "surrogate": 0.0}
    with torch.no_grad():
        for batch, mask, logp in _scored_batches(stream, model, lambda b: b.loss_mask):
            ok = mask & torch.isfinite(logp)
            a = batch.advantages
            for key, sel in (("pos", ok & (a > 0)), ("neg", ok & (a < 0))):
                s[key] += float(logp[sel].sum())
                s["n" + key] += int(sel.sum())
            s["surrogate"] += float((a[ok] * logp[ok]).sum())
    return {"logp_pos": round(s["pos"] / max(s["npos"], 1), 4), "logp_neg": round(s["neg"] / max(s["nneg"], 1), 4),
            "surrogate": round(s["surrogate"], 1)}


def main(argv: list[str] | None = None) -> int:
    from bench.learning import evaluate_policy
    from bench.run import BenchContext
    from trainer.config import deep_merge

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", required=True)
    ap.add_argument("--eval-tasks", type=int, default=24)
    args = ap.parse_args(argv)
    version = json.loads((args.model / "policy.json").read_text())["version"]
    ctx = BenchContext(args.out / "broker")

    def report(name: str, model: Path) -> None:
        r = evaluate_policy(model, bootstrap=ctx.bootstrap, topic=f"direction-{name}", spool=args.out / "spool",
                            domains=("code", "tools"), levels=(0, 1), tasks=args.eval_tasks, max_steps=6,
                            max_tokens=64, policy_version=version, temperature=1.0, seed=7)
        rate = sum(c["passed"] for c in r.values()) / sum(c["episodes"] for c in r.values())
        print(json.dumps({"variant": name, "sampled_pass_rate": round(rate, 4), **score(args.data, model, version),
                          **{k: f'{c["passed"]}/{c["episodes"]}' for k, c in sorted(r.items())}}), flush=True)

    try:
        report("start", args.model)
        for name, overrides in json.loads(args.variants).items():
            cfg = deep_merge(yaml.safe_load((REPO / "trainer/configs/grpo-loop.yaml").read_text()), overrides)
            run = args.out / name
            run.mkdir(parents=True, exist_ok=True)
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
            with (run / "train.log").open("w") as log:
                proc = subprocess.run([sys.executable, "-m", "trajpipe", "train", "--config", str(run / "config.yaml"),
                                       "--data", str(args.data), "--model", str(args.model), "--out", str(run / "train"),
                                       "--publish-every", str(cfg["max_steps"])], cwd=REPO, stdout=subprocess.DEVNULL,
                                      stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
            published = sorted((run / "train" / "policies").glob("v*"), key=lambda p: int(p.name[1:]))
            if proc.returncode or not published:
                print(json.dumps({"variant": name, "error": f"train exited {proc.returncode}; see {run / 'train.log'}"}))
                continue
            report(name, published[-1])
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
