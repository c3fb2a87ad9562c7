"""``math`` domain: multi-step arithmetic and algebra word problems.

Every problem names its intermediate quantities; the policy reports each one,
so intermediate results are checkable step by step, not only the answer.

Action format (one per turn; the verb is case-insensitive)::

    CALC <expression>        evaluate + - * / ** ( ) on numbers (a calculator tool)
    STATE <name> = <value>   report an intermediate quantity named in the problem (checked)
    ANSWER <value>           final answer; ends the episode

Difficulty levels: 0 = two-step purchases, 1 = discount-then-tax and average
speed (four steps), 2 = 2x2 linear systems and multi-year compound interest.
Values are compared with an absolute tolerance of 0.01 (answers are asked to
two decimals).
"""

from __future__ import annotations

import ast
import operator
import random

from rollout.envs.base import EnvironmentFailure, Outcome, StepOutcome, Task, dump_json, make_task_id, split_action
from rollout.verifiers import numbers_match, parse_number, verify_step

__all__ = ["MathEnv", "generate_task", "safe_eval", "MAX_DIFFICULTY"]

DOMAIN = "math"
MAX_DIFFICULTY = 2

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow}
_UNOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_eval(expr: str) -> float:
    """Evaluate an arithmetic expression without ``eval`` (numbers and + - * / ** only).

    Raises:
        ValueError: anything else in the expression, or an exponent above 100.

    Examples:
        >>> safe_eval("(3 + 4) * 2.5 - 1/4")
        17.25
    """
    if len(expr) > 500:
        raise ValueError("expression longer than 500 characters")

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

    try:
        return float(ev(ast.parse(expr.replace(",", ""), mode="eval")))
    except (SyntaxError, ZeroDivisionError, OverflowError) as err:
        raise ValueError(str(err)) from err


def _r2(x: float) -> float:
    return round(x + 0.0, 2)


def _purchase(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    price, qty, ship = rng.randint(2, 40) + rng.choice([0, 0.25, 0.5, 0.75]), rng.randint(2, 12), rng.randint(3, 15)
    item = rng.choice(["notebooks", "pencils", "mugs", "cables"])
    q = (f"A shop sells {item} at ${price} each. Maya buys {qty} {item} and pays a flat ${ship} shipping fee. "
         f"How much does she pay in total? Quantities: subtotal, total.")
    return q, [("subtotal", f"{price} * {qty}"), ("total", f"subtotal + {ship}")]


def _discount_tax(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    p, d, t = rng.randint(40, 400), rng.choice([10, 15, 20, 25, 30]), rng.choice([5, 7, 8, 10])
    q = (f"A jacket costs ${p}. It is discounted by {d}%, then a sales tax of {t}% is added to the discounted price. "
         f"What is the final price, to two decimals? Quantities: discount, discounted, tax, total.")
    return q, [("discount", f"{p} * {d} / 100"), ("discounted", f"{p} - discount"),
               ("tax", f"discounted * {t} / 100"), ("total", "discounted + tax")]


def _avg_speed(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    a, v1, b, v2 = rng.randint(2, 9) * 20, rng.choice([40, 50, 60, 80]), rng.randint(2, 9) * 15, rng.choice([30, 45, 60, 90])
    q = (f"A train travels {a} km at {v1} km/h, then {b} km at {v2} km/h. What is its average speed over the "
         f"whole trip in km/h, to two decimals? Quantities: time1, time2, total_time, average.")
    return q, [("time1", f"{a} / {v1}"), ("time2", f"{b} / {v2}"), ("total_time", "time1 + time2"),
               ("average", f"({a} + {b}) / total_time")]


def _linear_system(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    while True:
        x, y = rng.randint(-9, 9), rng.randint(-9, 9)
        a1, b1, a2, b2 = (rng.randint(1, 9) * rng.choice([1, -1]) for _ in range(4))
        if a1 * b2 - a2 * b1 != 0:
            break
    c1, c2 = a1 * x + b1 * y, a2 * x + b2 * y
    q = (f"Solve {a1}x + {b1}y = {c1} and {a2}x + {b2}y = {c2}. What is x + 2y? "
         f"Quantities: det, x, y, result.")
    return q, [("det", f"{a1} * {b2} - {a2} * {b1}"), ("x", f"({c1} * {b2} - {c2} * {b1}) / det"),
               ("y", f"({a1} * {c2} - {a2} * {c1}) / det"), ("result", "x + 2 * y")]


def _compound(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    p, r, n, w = rng.randint(10, 90) * 100, rng.choice([2, 3, 4, 5]), rng.randint(2, 4), rng.randint(1, 9) * 50
    steps = [("balance_year_1", f"{p} * (1 + {r} / 100) - {w}")]
    for year in range(2, n + 1):
        steps.append((f"balance_year_{year}", f"balance_year_{year - 1} * (1 + {r} / 100) - {w}"))
    names = ", ".join(s for s, _ in steps)
    q = (f"An account starts with ${p}, earns {r}% interest compounded yearly, and ${w} is withdrawn at the end of "
         f"each year after interest. What is the balance after {n} years, to two decimals? Quantities: {names}.")
    return q, steps


_GENERATORS = {0: [_purchase], 1: [_discount_tax, _avg_speed], 2: [_linear_system, _compound]}


def generate_task(seed: int, index: int, difficulty: int) -> Task:
    """One ``math`` task, deterministic in (seed, index, difficulty)."""
    if not 0 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"`difficulty` for math must be in 0..{MAX_DIFFICULTY}, got {difficulty}")
    rng = random.Random(f"math:{seed}:{index}:{difficulty}")
    question, raw_steps = rng.choice(_GENERATORS[difficulty])(rng)
    values: dict[str, float] = {}
    steps = []
    for name, expr in raw_steps:
        concrete = expr
        for prev in sorted(values, key=len, reverse=True):
            concrete = concrete.replace(prev, repr(values[prev]))
        values[name] = _r2(safe_eval(concrete)) if name != "det" else safe_eval(concrete)
        steps.append({"name": name, "expr": expr, "value": values[name]})
    spec = {"question": question, "steps": steps, "answer": steps[-1]["value"], "tolerance": 0.01}
    prompt = (
        f"{question}\n\nRound each quantity to two decimals.\n"
        "Actions (one per turn):\n"
        "CALC <expression>       -- calculator (+ - * / ** and parentheses)\n"
        "STATE <name> = <value>  -- report a named quantity\n"
        "ANSWER <value>          -- final answer"
    )
    return Task(domain=DOMAIN, difficulty=difficulty, task_id=make_task_id(DOMAIN, difficulty, seed, index),
                spec=spec, prompt=prompt)


class MathEnv:
    """The ``math`` environment (no sandbox: the calculator is an AST evaluator)."""

    domain = DOMAIN

    def __init__(self) -> None:
        self._task: Task | None = None
        self._answer: float | None = None
        self._stated: dict[str, bool] = {}
        self._done = False

    def config(self) -> dict:
        return {"calculator": "ast", "tolerance": 0.01}

    def reset(self, task: Task) -> str:
        self._task, self._answer, self._stated, self._done = task, None, {}, False
        return task.prompt

    def close(self) -> None:
        self._task = None

    def step(self, action: str) -> StepOutcome:
        if self._task is None:
            raise EnvironmentFailure("step() before reset()")
        verb, rest, _ = split_action(action)
        if verb == "CALC" and rest:
            try:
                value, error = safe_eval(rest), None
                obs = f"{rest} = {value:.10g}"
            except ValueError as err:
                value, error = None, str(err)
                obs = f"calculator error: {err}"
            out = StepOutcome(observation=obs, tool_name="calc", tool_args=dump_json({"expr": rest}),
                              tool_result=dump_json({"value": value, "error": error}))
        elif verb == "STATE" and "=" in rest:
            name, _, value = rest.partition("=")
            out = StepOutcome(observation=f"noted {name.strip()} = {value.strip()}", tool_name="state",
                              tool_args=dump_json({"name": name.strip(), "value": value.strip()}))
        elif verb == "ANSWER" and rest:
            self._answer, self._done = parse_number(rest), True
            out = StepOutcome(observation="answer recorded", tool_name="answer",
                              tool_args=dump_json({"value": rest}), done=True)
        else:
            out = StepOutcome(observation="invalid action; use CALC <expr>, STATE <name> = <value> or ANSWER <value>",
                              tool_name="invalid", tool_args=dump_json({"action": action[:200]}))
        out.verdicts = verify_step(DOMAIN, self._task.spec, out.recorded(action))
        if out.tool_name == "state":
            self._stated[rest.partition("=")[0].strip()] = all(v.passed for v in out.verdicts)
        return out

    def outcome(self) -> Outcome:
        if self._task is None:
            raise EnvironmentFailure("outcome() before reset()")
        ok = numbers_match(self._answer, float(self._task.spec["answer"]), float(self._task.spec["tolerance"]))
        good = sum(self._stated.values())
        return Outcome(status="success" if ok else "failure", reward=1.0 if ok else 0.0,
                       summary=f"answer {'correct' if ok else 'wrong or missing'}; "
                               f"{good}/{len(self._task.spec['steps'])} intermediates stated correctly")
