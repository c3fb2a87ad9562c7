"""SIGKILL at each point of the trainer's checkpoint → write version → announce sequence, then ``--resume``:
one set of weights per version number, contiguous versions, a linear parent chain, exact continuation.

The trainer (trainer/recipes/rl.py ``_checkpoint_and_publish``) checkpoints a version's weights before it
writes and announces the version; a resume from such a checkpoint finishes the publication with the same
weights. Before, it published first: killed between the two, it resumed from the previous checkpoint and
trained the lineage on into a fork.

The crash points are injected by this test, not by the trainer: a driver process imports the trainer once,
then forks one child per run; the child wraps the recipe's functions so that it SIGKILLs itself at the chosen
point. The announcements go to a file (the control topic's role: each line is one ``policy_published``,
written and fsynced before the call returns), with the sha256 of the announced weights file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from trainer.publish import read_policy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

DRIVER = r"""
import hashlib, json, os, signal, sys, time
from pathlib import Path

import trainer.recipes.rl as rl
from trainer.config import load_train_config

# What each run would import lazily (most of a run's time), imported once here before the forks.
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (DeepSpeed's optimizer check imports it)
import transformers.models.llama.modeling_llama  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

plan = json.loads(sys.argv[1])


def run_child(crash_at, crash_step, out):
    announced = Path(out) / "announced.jsonl"

    def die(point, step):
        if point == crash_at and step == crash_step:
            os.kill(os.getpid(), signal.SIGKILL)

    save_checkpoint, write_policy = rl.RLRecipe.save_checkpoint, rl.write_policy

    def checkpoint_hooked(self, *, publish_version=None):
        if publish_version is not None:
            die("before_checkpoint", self.step)
        save_checkpoint(self, publish_version=publish_version)
        if publish_version is not None:
            die("after_checkpoint", self.step)

    def write_hooked(store, **kw):
        record = write_policy(store, **kw)
        die("after_store_write", kw["train_step"])
        return record

    def announce(event):
        sha = hashlib.sha256((Path(event.location) / "model.safetensors").read_bytes()).hexdigest()
        with open(announced, "a") as f:
            f.write(json.dumps({"version": event.version, "parent_version": event.parent_version,
                                "train_step": event.train_step, "lineage": event.lineage, "sha": sha}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        die("after_announce", event.train_step)

    rl.RLRecipe.save_checkpoint, rl.write_policy = checkpoint_hooked, write_hooked
    cfg = load_train_config(None, model=plan["model"], out=out, resume=True, max_steps=plan["max_steps"],
                            log_sample_ids=True, **{"data.dir": plan["data"], **plan["over"]})
    rl.run(cfg, emit_event=announce, progress=False)


results = []
for out, crash_at, crash_step in plan["runs"]:
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            run_child(crash_at, crash_step, out)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(f"run {out} {crash_at}@{crash_step}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    results.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
print(json.dumps(results))
"""

#: What in-process trainer tests leave in this process's environment (trainer/engine.py sets them for a lone
#: process). Inherited, each forked run would join through that MASTER_PORT, which a SIGKILLed run leaves in
#: TIME_WAIT (EADDRINUSE); without them every run rendezvous through its own file store.
_PROCESS_GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: publish every 2 steps; one kill per point of the sequence, each at a later version of the same run.
CRASHES = [("after_checkpoint", 2), ("after_store_write", 4), ("after_announce", 6), ("before_checkpoint", 8)]
MAX_STEPS = 8
OVER = {"data.seq_len": 64, "data.batch_size": 2, "optim.lr": 1e-3, "objective.name": "ppo", "publish.every": 2,
        "data.max_epochs": None}


def _runs_of(out: Path) -> list[list[int]]:
    """The steps taken by each run (process start) in order: metrics.jsonl starts each run with its config line."""
    runs: list[list[int]] = []
    for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        if "config" in d:
            runs.append([])
        elif "train/loss" in d:
            runs[-1].append(d["step"])
    return runs


def _samples_of(out: Path) -> list[tuple[int, list[str]]]:
    return [(d["step"], d["sample_ids"]) for d in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
            if "step" in d]


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_sigkill_at_each_point_of_publish_and_checkpoint_never_forks_the_lineage(tiny_model, vocab_size,
                                                                                 make_dataset, tmp_path):
    data = make_dataset((30, 20), vocab_size=vocab_size, row_group_size=4)
    crashed, reference = tmp_path / "crashed", tmp_path / "reference"
    runs = [[str(crashed), point, step] for point, step in CRASHES] + [[str(crashed), None, None],
                                                                       [str(reference), None, None]]
    plan = {"model": str(tiny_model), "data": str(data), "max_steps": MAX_STEPS, "over": OVER, "runs": runs}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(plan)], cwd=REPO, capture_output=True,
                          text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in _PROCESS_GROUP_ENV}
                          | {"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    print("\n".join(line for line in proc.stderr.splitlines() if line.startswith("run ")))  # each run's wall time
    # every injected kill happened, and the final run and the uninterrupted reference ended normally
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [-9, -9, -9, -9, 0, 0], proc.stderr[-4000:]

    announced = [json.loads(x) for x in (crashed / "announced.jsonl").read_text().splitlines()]
    shas: dict[int, set[str]] = defaultdict(set)
    for a in announced:
        shas[a["version"]].add(a["sha"])
    # v1 announced by the resume after the kill between its checkpoint and its write, v2 by the resume after
    # the kill between its write and its announcement; v3 announced, then again (same weights) by each of the
    # two resumes from its checkpoint; v4 trained again after the kill before its checkpoint, announced once
    assert [a["version"] for a in announced] == [1, 2, 3, 3, 3, 4]
    # one set of weights per version number, and it is the one in the store
    assert {v: len(s) for v, s in shas.items()} == {1: 1, 2: 1, 3: 1, 4: 1}
    store = crashed / "policies"
    assert sorted(p.name for p in store.iterdir()) == ["v1", "v2", "v3", "v4"]  # contiguous, no orphan
    for v, (sha,) in shas.items():
        assert _sha(store / f"v{v}") == sha
        rec = read_policy(store / f"v{v}")
        assert (rec.version, rec.parent_version, rec.train_step) == (v, v - 1, 2 * v)
    assert len({a["lineage"] for a in announced}) == 1 and all(a["parent_version"] == a["version"] - 1
                                                               for a in announced)

    # each resume continued from the right step: the checkpoint of the version being published (steps 2, 4,
    # 6) or, killed before the step-8 checkpoint, the step-6 one, and then saw the same samples again
    assert _runs_of(crashed) == [[1, 2], [3, 4], [5, 6], [7, 8], [7, 8]]
    samples = _samples_of(crashed)
    assert [s for s, _ in samples] == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8]
    assert samples[6:8] == samples[8:10]
    assert samples[:6] + samples[8:] == _samples_of(reference)
    # the published weights are those of the uninterrupted run (same samples, model and optimizer state restored)
    ref_store = reference / "policies"
    assert [_sha(ref_store / f"v{v}") for v in (1, 2, 3, 4)] == [shas[v].copy().pop() for v in (1, 2, 3, 4)]
