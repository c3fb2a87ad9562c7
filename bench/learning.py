"""Does a policy trained on our datasets get better? The learning figures, measured on the real path.

Everything goes through the product's own commands and data, as a user would run them:

1. **Warm start** (the offline path, item 3 of issue 13): ``trajpipe model init-tiny`` → scripted
   demonstrations in the tiny model's tokens (``trajpipe rollout --policy scripted --model tiny
   --domains code,tools --levels 0,1 --seed DEMO_SEED``) → Kafka → ``trajpipe pipeline run --source
   kafka`` → ``trajpipe train --config trainer/configs/bc-warmstart-loop.yaml`` (behaviour cloning,
   DeepSpeed) → policy v1.
2. **Held-out evaluation** of the base model and of every published version: the
   rollout worker with the ``hf`` policy at temperature 0 (greedy) on a fixed set of held-out
   tasks per (domain, level) -- the held-out pool of ``trajpipe eval`` (:func:`rollout.heldout.heldout_tasks`,
   disjoint by content from every demonstration and training task) -- whose episodes go through Kafka to their own topic (never into a training dataset).
3. **Online GRPO** from v1: one ``trajpipe loop`` run for the budget (``engine="loop"``, the default: the
   product's asynchronous loop, ``trajpipe/configs/loop-learning.yaml``), its published versions evaluated
   afterwards; or (``engine="commands"``) each iteration the real commands: the current policy's rollouts in
   groups (``hf``, sampled, training seed ``TRAIN_SEED + i``, levels 0-1) → Kafka →
   ``trajpipe pipeline run --source kafka`` (the new micro-batch; complete-group advantages) →
   ``trajpipe train --config trainer/configs/grpo-loop.yaml --model <current>`` (GRPO,
   staleness 0, continues the lineage: v(n) → v(n+1)) → evaluation of the new version.
   Iterations run until the wall-clock budget (rollouts + Beam job + training, evaluation not
   counted: in ``trajpipe loop`` the evaluator runs beside the loop) is spent.

Figures (into ``bench/results/latest.json``):

* ``bc_heldout_pass_rate``: v1's pass rate on the held-out level-0 tasks of the domains (goal >= 0.5);
  ``bc_base_heldout_pass_rate`` the base model's on the same tasks.
* ``loop_pass_rate_gain``: best held-out pass rate (level 0-1 mix; sampled pass@1 at the training
  temperature, ``eval_sampled_tasks`` per cell, the same seed for every version) of a version published
  within the budget minus v1's, in points of pass rate (0.10 = 10 points; goal >= 0.10 in 15 minutes).
  ``loop_pass_rate_gain_last`` is the last version's gain (no choice of version);
  ``loop_greedy_pass_rate_gain`` (``_last``) the same on greedy decoding.
* ``learning_v<N>_pass_rate`` (sampled), ``learning_v<N>_greedy_pass_rate`` and ``learning_v<N>_<domain>``
  (sampled): the curve, level 0-1 mix.
  The whole curve (per version, domain and level, with the wall-clock time of each version) is
  also written to ``bench/results/learning_curve.json``.

Budget: ``make bench`` runs the loop for ``TRAJPIPE_BENCH_LOOP_BUDGET_S`` seconds (default 240);
the 15-minute figure of the issue is ``--budget-s 900``::

    .venv/bin/python -m bench.learning --budget-s 900          # own broker, full figure
    TRAJPIPE_BENCH_LOOP_BUDGET_S=900 .venv/bin/python -m bench.run learning
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["LearningSetup", "bench_learning", "evaluate_policy", "main"]

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "trainer" / "configs"
RESULTS = Path(__file__).with_name("results")


@dataclass(frozen=True)
class LearningSetup:
    """The recipe of the learning figures.

    Attributes:
        domains: the domains demonstrated, trained and evaluated.
        model_args: ``trajpipe model init-tiny`` flags (the default: 2 layers, hidden 128, ~0.94 M parameters).
        demo_episodes: scripted demonstrations (levels ``demo_levels``).
        demo_levels: difficulty levels of the demonstrations.
        demo_noise: probability of a wrong scripted decision (the failures are demonstrations of a
            failure and its recovery, e.g. a rewrite after failing tests; BC clones every step).
        demo_seed: task seed of the demonstrations.
        bc_config: warm-start recipe (``trajpipe train --config``).
        eval_tasks: held-out tasks per (domain, level) of the greedy evaluation.
        eval_sampled_tasks: held-out tasks per (domain, level) of the sampled evaluation (pass@1 at the
            training temperature; 0 = no sampled evaluation).
        eval_seed: sampling seed of the sampled evaluation, the same for every version (paired comparison).
        base_eval_tasks: held-out level-0 tasks per domain for the base model (a random-init model never
            stops early: each of its actions costs ``max_tokens``; the first ``base_eval_tasks`` of the
            same held-out tasks).
        eval_max_steps: steps per evaluation episode.
        max_tokens: new tokens per action (evaluation and training rollouts).
        train_seed: training rollouts of iteration ``i`` use seed ``train_seed + i``.
        train_levels: level mix of the training rollouts and of the loop's evaluation.
        group_size: GRPO group size.
        groups_per_iter: groups of rollouts per iteration.
        temperature: sampling temperature of the training rollouts.
        train_max_steps: steps per training episode.
        grpo_config: GRPO recipe (``trajpipe train --config``), optimizer steps per iteration in it.
        budget_s: wall-clock budget of the online loop, seconds.
        base_model: start from this model directory instead of ``trajpipe model init-tiny`` (e.g. a local
            Qwen2.5-0.5B-Instruct on a GPU machine, bench/gpu_loop.sh).
        policy: rollout and evaluation engine, ``hf`` or ``vllm``.
        eval_base: evaluate the base model too (``bc_base_heldout_pass_rate``).
        warm_start: skip the warm start and start the online loop from this published policy directory
            (e.g. ``<workdir>/bc/policies/v1`` of an earlier run); no ``bc_*`` figures then.
        engine: ``loop``: the online phase is one ``trajpipe loop --config loop_config`` run (the product's
            asynchronous loop: rollouts, Beam micro-batches and the online trainer at once) for ``budget_s``,
            whose published versions are evaluated afterwards; ``commands``: rollout → pipeline → train
            commands in turn per iteration (``grpo_config``, ``groups_per_iter``).
        loop_config: the loop's config (``run_dir``, ``model``, ``bootstrap`` and the budget are set here).
        loop_eval_versions: versions of the loop evaluated (evenly spaced, the last always), besides v1.
    """

    domains: tuple[str, ...] = ("code", "tools")
    model_args: tuple[str, ...] = ()
    demo_episodes: int = 160
    demo_levels: str = "0,1"
    demo_noise: float = 0.0
    demo_seed: int = 1
    bc_config: Path = CONFIGS / "bc-warmstart-loop.yaml"
    eval_tasks: int = 8
    eval_sampled_tasks: int = 24
    eval_seed: int = 7
    base_eval_tasks: int = 4
    eval_max_steps: int = 6
    max_tokens: int = 64
    train_seed: int = 100
    train_levels: tuple[int, ...] = (0, 1)
    group_size: int = 8
    groups_per_iter: int = 6
    temperature: float = 1.0
    train_max_steps: int = 6
    grpo_config: Path = CONFIGS / "grpo-loop.yaml"
    budget_s: float = 240.0
    base_model: Path | None = None
    policy: str = "hf"
    eval_base: bool = True
    warm_start: Path | None = None
    engine: str = "loop"
    loop_config: Path = REPO / "trajpipe" / "configs" / "loop-learning.yaml"
    loop_eval_versions: int = 6


@dataclass
class _Point:
    """One evaluated version of the curve."""

    policy_version: int
    elapsed_s: float
    by_domain_level: dict[str, dict] = field(default_factory=dict)
    sampled: dict[str, dict] = field(default_factory=dict)

    def rate(self, *, domains: tuple[str, ...] | None = None, levels: tuple[int, ...] | None = None,
             sampled: bool = False) -> float:
        cells = [c for k, c in (self.sampled if sampled else self.by_domain_level).items()
                 if (domains is None or k.split("/")[0] in domains)
                 and (levels is None or int(k.split("/")[1]) in levels)]
        episodes = sum(c["episodes"] for c in cells)
        return sum(c["passed"] for c in cells) / episodes if episodes else 0.0


def _topic_env(topic: str, spool: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "TRAJPIPE_TOPICS__EVENTS": topic,
            "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl", "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl",
            "TRAJPIPE_TOPICS__PARTITIONS": "2", "TRAJPIPE_SPOOL_DIR": str(spool)}


def _trajpipe(env: dict, log: Path, *args) -> dict:
    """Run one ``trajpipe`` command; its last stdout line (JSON counts). Its stderr goes to ``log``."""
    with log.open("a") as err:
        err.write(f"\n$ trajpipe {' '.join(map(str, args))}\n")
        err.flush()
        proc = subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"trajpipe {' '.join(map(str, args))} exited {proc.returncode}; see {log}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def evaluate_policy(model: Path, *, bootstrap: str, topic: str, spool: Path, domains: tuple[str, ...],
                    levels: tuple[int, ...], tasks: int, max_steps: int, max_tokens: int,
                    policy_version: int = 0, policy: str = "hf", temperature: float = 0.0,
                    seed: int = 0) -> dict[str, dict]:
    """Pass rate of ``model`` on held-out tasks: what ``trajpipe eval`` runs (:func:`rollout.evaluate.run_evaluation`).

    Greedy (``temperature`` 0: pass@1 of the argmax policy) or sampled (pass@1 of the policy as it acts
    in training, one sample per task: the unbiased pass@k estimator of Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", §2.1, at k = n = 1, averaged over the tasks).

    The first ``tasks`` of each (domain, level) pool of :func:`rollout.heldout.heldout_tasks` (disjoint by content
    from every demonstration and training task: the training scheduler skips them), run by the real rollout
    worker (``policy``: ``hf`` or ``vllm``; sandboxed environments), their episodes (purpose ``eval``) emitted to
    ``topic``.

    Returns:
        ``{"<domain>/<level>": {"episodes": n, "passed": k, "pass_rate": k / n}}``.
    """
    from rollout.evaluate import EvalConfig, load_policy, run_evaluation
    from streams.admin import ensure_topics
    from streams.config import KafkaConnection, Topics
    from streams.producer import EventProducer

    conn = KafkaConnection(bootstrap_servers=bootstrap)
    ensure_topics(conn, Topics(events=topic, dead_letters=f"{topic}.dl", control=f"{topic}.ctl", partitions=2))
    config = EvalConfig(domains=domains, levels=levels, tasks_per_level=tasks, max_steps=max_steps,
                        max_tokens=max_tokens, temperature=temperature, seed=seed,
                        concurrency=16 if policy == "vllm" else 4,
                        producer_id="bench-learning-eval")
    actor = load_policy(policy, str(model), version=policy_version, config=config)
    try:
        with EventProducer(conn, topic, spool_dir=spool) as producer:
            result = run_evaluation(actor, emit=producer.emit, config=config)
            producer.flush()
    finally:
        close = getattr(actor, "close", None)
        if close is not None:
            close()
    return {k: {"episodes": c.episodes, "passed": c.passed, "pass_rate": round(c.pass_rate, 4)}
            for k, c in result.by_domain_level.items()}


def _online_loop(setup: LearningSetup, v1: Path, run_dir: Path, bootstrap: str, logs: Path) -> dict:
    """``trajpipe loop`` from ``v1`` for ``setup.budget_s``; its published versions ``(version, dir, seconds in)``."""
    import yaml

    doc = yaml.safe_load(setup.loop_config.read_text())
    doc.update(run_dir=str(run_dir), model=str(v1), bootstrap=bootstrap, budget={"seconds": setup.budget_s})
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg = run_dir.parent / "loop-learning.yaml"
    cfg.write_text(f"# trajpipe loop --config {cfg}\n" + yaml.safe_dump(doc, sort_keys=False))
    t0 = time.time()
    summary = _trajpipe({**os.environ, "PYTHONPATH": str(REPO)}, logs, "loop", "--config", cfg)
    versions = []
    for v in summary["policy_versions"]:
        path = run_dir / "train" / "policies" / f"v{v}"
        versions.append((v, path, (path / "policy.json").stat().st_mtime - t0))
    return {"summary": summary, "versions": versions, "seconds": summary["seconds"],
            "trained_steps": summary["trained_steps"]}


def _spread(items: list, n: int) -> list:
    """At most ``n`` of ``items``, evenly spaced, the last always included.

    Examples:
        >>> _spread([2, 3, 4, 5, 6, 7, 8, 9, 10], 3)
        [4, 7, 10]
        >>> _spread([2, 3], 6)
        [2, 3]
    """
    if len(items) <= n:
        return list(items)
    step = len(items) / n
    return [items[min(len(items) - 1, round((i + 1) * step) - 1)] for i in range(n)]


def bench_learning(bootstrap: str, workdir: Path, setup: LearningSetup = LearningSetup(), *,
                   log=print) -> dict:
    """Warm start, then online GRPO for ``setup.budget_s``; the learning figures and the curve.

    Returns:
        The flat figures (see the module docstring); the curve is also in ``workdir / "curve.json"``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    run = uuid.uuid4().hex[:8]
    logs = workdir / "commands.log"
    demos_env = _topic_env(f"learn.{run}.demos", workdir / "spool-demos")
    rl_env = _topic_env(f"learn.{run}.rl", workdir / "spool-rl")
    eval_topic = f"learn.{run}.eval"
    domains = ",".join(setup.domains)
    all_levels = tuple(sorted({0, *setup.train_levels}))

    def evaluate(model: Path, version: int, elapsed: float, *, levels: tuple[int, ...] = all_levels,
                 tasks: int = setup.eval_tasks, sampled: bool = True) -> _Point:
        t0 = time.perf_counter()
        kw = dict(bootstrap=bootstrap, topic=eval_topic, spool=workdir / "spool-eval", domains=setup.domains,
                  levels=levels, max_steps=setup.eval_max_steps, max_tokens=setup.max_tokens,
                  policy_version=version, policy=setup.policy)
        point = _Point(policy_version=version, elapsed_s=round(elapsed, 1),
                       by_domain_level=evaluate_policy(model, tasks=tasks, **kw))
        if sampled and setup.eval_sampled_tasks:
            point.sampled = evaluate_policy(model, tasks=setup.eval_sampled_tasks, temperature=setup.temperature,
                                            seed=setup.eval_seed, **kw)
        cells = lambda d: json.dumps({k: f"{c['passed']}/{c['episodes']}" for k, c in sorted(d.items())})  # noqa: E731
        log(f"v{version} @ {elapsed:.0f} s: greedy level 0 {point.rate(levels=(0,)):.3f}, levels "
            f"{setup.train_levels} {point.rate(levels=setup.train_levels):.3f} {cells(point.by_domain_level)}; "
            f"sampled {point.rate(levels=setup.train_levels, sampled=True):.3f} {cells(point.sampled)} "
            f"(eval {time.perf_counter() - t0:.0f} s)")
        return point

    # 1. warm start from the log (or from an earlier run's published policy)
    t_warm = time.perf_counter()
    params = warm_s = base = None
    if setup.warm_start is not None:
        v1, v1_version = setup.warm_start, int(setup.warm_start.name.lstrip("v"))
    else:
        if setup.base_model is None:
            tiny = workdir / "tiny"
            params = _trajpipe(demos_env, logs, "model", "init-tiny", "--out", tiny, *setup.model_args)["params"]
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            tiny = setup.base_model
            with __import__("torch").device("meta"):
                params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny)).parameters())
        demo = _trajpipe(demos_env, logs, "rollout", "--bootstrap", bootstrap, "--policy", "scripted", "--model", tiny,
                         "--domains", domains, "--levels", setup.demo_levels, "--episodes", setup.demo_episodes,
                         "--noise", setup.demo_noise, "--seed", setup.demo_seed, "--concurrency", 4)
        demos = workdir / "demos"
        _trajpipe(demos_env, logs, "pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap, "--out", demos)
        bc = _trajpipe(demos_env, logs, "train", "--config", setup.bc_config, "--data", demos, "--model", tiny,
                       "--out", workdir / "bc")
        v1_version = bc["policy_version"]
        v1 = workdir / "bc" / "policies" / f"v{v1_version}"
        warm_s = time.perf_counter() - t_warm
        log(f"warm start: {params} parameters, {demo['episodes']} demonstrations ({demo['passed']} passed), "
            f"{bc['steps']} BC steps, {warm_s:.0f} s")
        if setup.eval_base:
            base = evaluate(tiny, 0, 0.0, levels=(0,), tasks=setup.base_eval_tasks, sampled=False)
    curve = [evaluate(v1, v1_version, 0.0)]

    # 2. online GRPO from v1 until the budget is spent
    current, version, spent, iteration, trained_steps = v1, v1_version, 0.0, 0, 0
    iterations: list[dict] = []
    if setup.engine == "loop":
        loop = _online_loop(setup, v1, workdir / "loop", bootstrap, logs)
        spent, iteration, trained_steps = loop["seconds"], len(loop["versions"]), loop["trained_steps"]
        iterations.append(loop["summary"])
        for version, path, elapsed in _spread(loop["versions"], setup.loop_eval_versions):
            curve.append(evaluate(path, version, elapsed))
    while setup.engine == "commands" and spent < setup.budget_s:
        t0 = time.perf_counter()
        rollout = _trajpipe(rl_env, logs, "rollout", "--bootstrap", bootstrap, "--policy", setup.policy, "--model", current,
                  "--domains", domains, "--levels", ",".join(map(str, setup.train_levels)),
                  "--group-size", setup.group_size, "--episodes", setup.group_size * setup.groups_per_iter,
                  "--max-steps", setup.train_max_steps, "--max-tokens", setup.max_tokens,
                  "--temperature", setup.temperature, "--seed", setup.train_seed + iteration,
                  "--concurrency", setup.group_size, "--no-follow-policies")
        t1 = time.perf_counter()
        _trajpipe(rl_env, logs, "pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap,
                  "--out", workdir / "rl")
        t2 = time.perf_counter()
        out = workdir / f"grpo-{iteration}"
        summary = _trajpipe(rl_env, logs, "train", "--config", setup.grpo_config, "--data", workdir / "rl",
                            "--model", current, "--out", out)
        trained_steps += summary["steps"]
        version = summary["policy_version"]
        current = out / "policies" / f"v{version}"
        t3 = time.perf_counter()
        spent += t3 - t0
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in steps if "perf/step_time_s" in m]
        iterations.append({
            "policy_version": version, "rollout_s": round(t1 - t0, 1), "pipeline_s": round(t2 - t1, 1),
            "train_s": round(t3 - t2, 1), "episodes": rollout["episodes"], "passed": rollout["passed"],
            "train_steps": summary["steps"], "train_tokens": summary["tokens"],
            "train_step_s": round(sum(m["perf/step_time_s"] for m in steps), 2),
            "train_reward": round(sum(m.get("train/reward", 0.0) for m in steps) / max(len(steps), 1), 4)})
        log(f"iteration {iteration}: {json.dumps(iterations[-1])}")
        iteration += 1
        curve.append(evaluate(current, version, spent))

    # The loop's figures are on the level 0-1 mix, sampled (pass@1 at the training temperature: the policy
    # the loop optimizes) and greedy (argmax decoding, the bc figure's decoding) side by side.
    sampled = bool(setup.eval_sampled_tasks)

    def gains(greedy: bool) -> tuple[float, float]:
        rate = lambda p: p.rate(levels=setup.train_levels, sampled=not greedy)  # noqa: E731
        start, last = rate(curve[0]), rate(curve[-1])
        best = max(rate(p) for p in curve[1:]) if curve[1:] else start
        return round(best - start, 4), round(last - start, 4)

    figures: dict[str, float] = {}
    if warm_s is not None:
        figures |= {"bc_heldout_pass_rate": round(curve[0].rate(levels=(0,)), 4), "bc_model_params": params,
                    "bc_warmstart_s": round(warm_s, 1)}
    gain, gain_last = gains(greedy=not sampled)
    greedy_gain, greedy_gain_last = gains(greedy=True)
    figures |= {
        "loop_pass_rate_gain": gain,
        "loop_pass_rate_gain_last": gain_last,
        "loop_greedy_pass_rate_gain": greedy_gain,
        "loop_greedy_pass_rate_gain_last": greedy_gain_last,
        "loop_budget_s": setup.budget_s,
        "loop_wall_s": round(spent, 1),
        "loop_iterations": iteration,
        "loop_train_steps": trained_steps,
    }
    for point in curve:
        v = point.policy_version
        figures[f"learning_v{v}_pass_rate"] = round(point.rate(levels=setup.train_levels, sampled=sampled), 4)
        figures[f"learning_v{v}_greedy_pass_rate"] = round(point.rate(levels=setup.train_levels), 4)
        for d in setup.domains:
            figures[f"learning_v{v}_{d}"] = round(point.rate(domains=(d,), levels=setup.train_levels, sampled=sampled), 4)
    if base is not None:
        figures["bc_base_heldout_pass_rate"] = round(base.rate(levels=(0,)), 4)
    curve_doc = {"setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(setup).items()},
                 "params": params, "figures": figures, "iterations": iterations,
                 "curve": [asdict(p) for p in ([base] if base else []) + curve]}
    (workdir / "curve.json").write_text(json.dumps(curve_doc, indent=1) + "\n")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("TRAJPIPE_BENCH_LOOP_BUDGET_S", 900)),
                        help="wall-clock budget of the online loop, seconds (default 900: the issue's figure)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: a temp dir)")
    parser.add_argument("--bootstrap", default=None, help="an existing broker (default: start one)")
    parser.add_argument("--model", type=Path, default=None, help="base model directory (default: init-tiny)")
    parser.add_argument("--policy", choices=("hf", "vllm"), default="hf", help="rollout and evaluation engine")
    parser.add_argument("--bc-config", type=Path, default=LearningSetup.bc_config)
    parser.add_argument("--grpo-config", type=Path, default=LearningSetup.grpo_config)
    parser.add_argument("--eval-tasks", type=int, default=LearningSetup.eval_tasks, help="per domain and level")
    parser.add_argument("--eval-sampled-tasks", type=int, default=LearningSetup.eval_sampled_tasks,
                        help="per domain and level, sampled at the training temperature (0: greedy only)")
    parser.add_argument("--groups-per-iter", type=int, default=LearningSetup.groups_per_iter)
    parser.add_argument("--engine", choices=("loop", "commands"), default=LearningSetup.engine,
                        help="loop: one `trajpipe loop` run; commands: rollout/pipeline/train per iteration")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="start the loop from this published policy directory (skip the warm start)")
    parser.add_argument("--loop-config", type=Path, default=LearningSetup.loop_config,
                        help="the online loop's config (--engine loop; run_dir, model, bootstrap, budget are set here)")
    parser.add_argument("--no-eval-base", action="store_true", help="skip the base model's evaluation")
    parser.add_argument("--results", action="store_true",
                        help="also write bench/results/learning_curve.json (the CPU figure's curve)")
    args = parser.parse_args(argv)
    import shutil
    import tempfile

    from bench.run import BenchContext

    setup = LearningSetup(budget_s=args.budget_s, base_model=args.model, policy=args.policy,
                          bc_config=args.bc_config.resolve(), grpo_config=args.grpo_config.resolve(),
                          eval_tasks=args.eval_tasks, eval_sampled_tasks=args.eval_sampled_tasks,
                          groups_per_iter=args.groups_per_iter, engine=args.engine,
                          loop_config=args.loop_config.resolve(),
                          warm_start=args.warm_start.resolve() if args.warm_start else None,
                          eval_base=not args.no_eval_base)
    with tempfile.TemporaryDirectory(prefix="trajpipe-learning-") as tmp:
        workdir = args.workdir or Path(tmp)
        ctx = BenchContext(Path(tmp))
        try:
            bootstrap = args.bootstrap or ctx.bootstrap
            figures = bench_learning(bootstrap, workdir, setup, log=lambda m: print(m, file=sys.stderr, flush=True))
        finally:
            ctx.close()
        if args.results:
            RESULTS.mkdir(exist_ok=True)
            shutil.copy(workdir / "curve.json", RESULTS / "learning_curve.json")
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
