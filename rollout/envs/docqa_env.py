"""``docqa`` domain: questions over long generated financial reports.

Each task renders an annual report of a fictional company: a dozen narrative
sections and tables (segment revenue and operating income over three years,
income statement, balance sheet, quarterly revenue, a peer comparison with
look-alike rows), several thousand tokens. Questions need two to four figures
located in different tables and a computation (growth %, margins, ratios,
percentage-point changes).

A figure's label is ``<table title> | <row> | <column>``, e.g.
``Segment revenue | Cloud Services | FY2023``; ``spec["figures"]`` maps every
label of the company's tables to its value (USD millions), so the verifiers can
check a citation without the report text. :func:`render_report` rebuilds the
report from the spec alone.

Action format (one per turn; the verb is case-insensitive)::

    SEARCH <words>                         report lines containing all the words (max 20)
    LOOKUP <table title>                   the whole table with that title
    CITE <table> | <row> | <column> = <v>  cite a figure used in the computation (checked)
    ANSWER <value>                         final answer (two decimals); ends the episode

Reward: 0.8 for a correct answer plus 0.2 x the fraction of required figures
cited correctly; ``success`` needs both the answer and every required figure.
"""

from __future__ import annotations

import random

from rollout.envs.base import EnvironmentFailure, Outcome, StepOutcome, Task, dump_json, make_task_id, split_action
from rollout.verifiers import numbers_match, parse_number, verify_step

__all__ = ["DocQAEnv", "generate_task", "render_report", "parse_table", "compute_answer", "MAX_DIFFICULTY"]

DOMAIN = "docqa"
MAX_DIFFICULTY = 2

_SEGMENT_POOL = ["Cloud Services", "Consumer Devices", "Enterprise Software", "Payments", "Logistics",
                 "Advertising", "Healthcare IT", "Industrial Sensors"]
_COMPANY_A = ["Northwind", "Bluefin", "Kestrel", "Orion", "Cedar", "Halcyon", "Meridian", "Vantage"]
_COMPANY_B = ["Holdings", "Systems", "Group", "Technologies", "Industries"]
_PEERS = ["Apex Corp", "Lumen Partners", "Stratus Inc"]
_FILLER = [
    "Management continued to prioritise disciplined capital allocation and operational efficiency.",
    "The company invested in automation across its fulfilment network and in talent development.",
    "Macroeconomic conditions remained uneven, with currency movements affecting reported results.",
    "The board reviewed the risk register quarterly and updated the enterprise risk appetite statement.",
    "Customer retention improved as the company expanded its subscription offerings.",
    "Supply chain constraints eased during the second half of the fiscal year.",
    "The company remains committed to its sustainability targets and reports progress annually.",
    "Cybersecurity investments focused on identity management and incident response readiness.",
    "Pricing actions partly offset inflation in labour and component costs.",
    "The company expanded into two new regional markets through organic growth.",
    "Working capital discipline contributed to stronger operating cash conversion.",
    "Litigation matters described in prior reports were resolved without material impact.",
]
_SECTIONS = ["Letter to shareholders", "Business overview", "Market environment", "Strategy", "Risk factors",
             "Governance", "Human capital", "Sustainability", "Liquidity and capital resources",
             "Critical accounting estimates", "Outlook"]


def _fmt(x: float) -> str:
    return f"{x:,.1f}"


def _years(spec: dict) -> list[str]:
    return [f"FY{y}" for y in spec["years"]]


def _tables(spec: dict) -> list[tuple[str, str, list[str], list[str], dict[str, float]]]:
    """(title, row header, rows, columns, figures-by-label) for every company table, in report order."""
    fig, years, segs = spec["figures"], _years(spec), spec["segments"]
    out = []
    for title, rows, row_header in (
        ("Segment revenue", segs, "Segment"),
        ("Segment operating income", segs, "Segment"),
        ("Income statement", ["Total revenue", "Cost of revenue", "Research and development",
                              "Selling, general and administrative", "Net income"], "Line item"),
        ("Balance sheet", ["Cash and equivalents", "Total assets", "Long-term debt", "Total liabilities",
                           "Shareholders' equity"], "Line item"),
    ):
        out.append((title, row_header, rows, years, fig))
    out.append(("Quarterly revenue", "Quarter", ["Q1", "Q2", "Q3", "Q4"], [years[-1]], fig))
    return out


def render_table(title: str, row_header: str, rows: list[str], cols: list[str], values: dict[str, float]) -> str:
    lines = [f"Table: {title} (USD millions)", "| " + " | ".join([row_header, *cols]) + " |",
             "|" + "---|" * (len(cols) + 1)]
    for row in rows:
        lines.append("| " + " | ".join([row, *(_fmt(values[f"{title} | {row} | {c}"]) for c in cols)]) + " |")
    return "\n".join(lines)


def render_report(spec: dict) -> str:
    """The full report text for a task spec (deterministic)."""
    rng = random.Random(spec["filler_seed"])
    company, years, segs, fig = spec["company"], _years(spec), spec["segments"], spec["figures"]
    last, prev = years[-1], years[-2]
    tables = {t[0]: t for t in _tables(spec)}
    parts = [f"# {company}: Annual Report {last}\n"]
    for i, section in enumerate(_SECTIONS):
        parts.append(f"## {i + 1}. {section}\n")
        parts.append(" ".join(rng.choice(_FILLER) for _ in range(rng.randint(12, 18))) + "\n")
        if section == "Business overview":
            parts.append(f"{company} reports {len(segs)} segments: {', '.join(segs)}.\n")
            parts.append(render_table(*tables["Segment revenue"]) + "\n")
            seg = rng.choice(segs)
            parts.append(f"{seg} revenue was ${_fmt(fig[f'Segment revenue | {seg} | {last}'])} million in {last}, "
                         f"compared with ${_fmt(fig[f'Segment revenue | {seg} | {prev}'])} million in {prev}.\n")
        elif section == "Market environment":
            parts.append(render_table(*tables["Segment operating income"]) + "\n")
        elif section == "Strategy":
            parts.append(render_table(*tables["Income statement"]) + "\n")
        elif section == "Liquidity and capital resources":
            parts.append(render_table(*tables["Balance sheet"]) + "\n")
        elif section == "Outlook":
            parts.append(render_table(*tables["Quarterly revenue"]) + "\n")
        elif section == "Governance":
            peers = spec["peers"]
            parts.append(f"Table: Peer comparison (USD millions, {last})")
            parts.append("| Company | Total revenue | Net income | Long-term debt |\n|---|---|---|---|")
            for name, vals in peers.items():
                parts.append(f"| {name} | {' | '.join(_fmt(v) for v in vals)} |")
            parts.append("")
    return "\n".join(parts)


def parse_table(text: str) -> dict[tuple[str, str], float]:
    """Parse a rendered table (as LOOKUP returns it) into {(row, column): value}."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    if len(lines) < 3:
        return {}
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for col, cell in zip(header[1:], cells[1:]):
            value = parse_number(cell)
            if value is not None:
                out[(cells[0], col)] = value
    return out


def compute_answer(formula: str, values: list[float]) -> float:
    """The answer from the required figures, in ``spec["required_figures"]`` order, to two decimals.

    Examples:
        >>> compute_answer("growth_pct", [200.0, 250.0])
        25.0
    """
    v = values
    if formula == "growth_pct":
        out = (v[1] - v[0]) / v[0] * 100
    elif formula == "ratio_pct":
        out = v[0] / v[1] * 100
    elif formula == "ratio":
        out = v[0] / v[1]
    elif formula == "combined_growth_pct":
        out = ((v[1] + v[3]) - (v[0] + v[2])) / (v[0] + v[2]) * 100
    elif formula == "margin_change_pp":
        out = v[2] / v[3] * 100 - v[0] / v[1] * 100
    else:
        raise ValueError(f"unknown docqa formula {formula!r}")
    return round(out, 2)


def _r1(x: float) -> float:
    return round(x, 1)


def generate_task(seed: int, index: int, difficulty: int) -> Task:
    """One ``docqa`` task, deterministic in (seed, index, difficulty)."""
    if not 0 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"`difficulty` for docqa must be in 0..{MAX_DIFFICULTY}, got {difficulty}")
    rng = random.Random(f"docqa:{seed}:{index}:{difficulty}")
    year0 = rng.randint(2015, 2023)
    years = [year0, year0 + 1, year0 + 2]
    fy = [f"FY{y}" for y in years]
    segs = rng.sample(_SEGMENT_POOL, rng.randint(3, 5))
    fig: dict[str, float] = {}
    for s in segs:
        rev = rng.uniform(300, 4000)
        for y in fy:
            rev *= rng.uniform(0.9, 1.25)
            fig[f"Segment revenue | {s} | {y}"] = _r1(rev)
            fig[f"Segment operating income | {s} | {y}"] = _r1(rev * rng.uniform(0.05, 0.3))
    for y in fy:
        total = _r1(sum(fig[f"Segment revenue | {s} | {y}"] for s in segs))
        fig[f"Income statement | Total revenue | {y}"] = total
        fig[f"Income statement | Cost of revenue | {y}"] = _r1(total * rng.uniform(0.4, 0.6))
        fig[f"Income statement | Research and development | {y}"] = _r1(total * rng.uniform(0.05, 0.15))
        fig[f"Income statement | Selling, general and administrative | {y}"] = _r1(total * rng.uniform(0.08, 0.15))
        fig[f"Income statement | Net income | {y}"] = _r1(total * rng.uniform(0.03, 0.15))
        assets = total * rng.uniform(1.2, 2.5)
        liabilities = assets * rng.uniform(0.3, 0.7)
        fig[f"Balance sheet | Cash and equivalents | {y}"] = _r1(assets * rng.uniform(0.05, 0.2))
        fig[f"Balance sheet | Total assets | {y}"] = _r1(assets)
        fig[f"Balance sheet | Long-term debt | {y}"] = _r1(liabilities * rng.uniform(0.3, 0.6))
        fig[f"Balance sheet | Total liabilities | {y}"] = _r1(liabilities)
        fig[f"Balance sheet | Shareholders' equity | {y}"] = _r1(_r1(assets) - _r1(liabilities))
    shares = [rng.uniform(0.2, 0.3) for _ in range(4)]
    for q, share in zip(["Q1", "Q2", "Q3", "Q4"], shares):
        fig[f"Quarterly revenue | {q} | {fy[-1]}"] = _r1(fig[f"Income statement | Total revenue | {fy[-1]}"] * share / sum(shares))
    peers = {p: [_r1(rng.uniform(500, 9000)), _r1(rng.uniform(20, 600)), _r1(rng.uniform(100, 3000))] for p in _PEERS}

    seg = rng.choice(segs)
    last, prev, first = fy[-1], fy[-2], fy[0]
    if difficulty == 0:
        a, b = f"Segment revenue | {seg} | {prev}", f"Segment revenue | {seg} | {last}"
        question = f"By what percentage did {seg} revenue grow from {prev} to {last}?"
        required, formula = [a, b], "growth_pct"
    elif difficulty == 1 and rng.random() < 0.5:
        a, b = f"Segment operating income | {seg} | {last}", f"Segment revenue | {seg} | {last}"
        question = f"What was the operating margin of {seg} in {last} (operating income / revenue, in percent)?"
        required, formula = [a, b], "ratio_pct"
    elif difficulty == 1:
        a, b = f"Balance sheet | Long-term debt | {last}", f"Balance sheet | Shareholders' equity | {last}"
        question = f"What was the ratio of long-term debt to shareholders' equity at the end of {last}?"
        required, formula = [a, b], "ratio"
    elif rng.random() < 0.5:
        s2 = rng.choice([s for s in segs if s != seg])
        required = [f"Segment revenue | {s} | {y}" for s in (seg, s2) for y in (first, last)]
        question = f"By what percentage did the combined revenue of {seg} and {s2} grow from {first} to {last}?"
        formula = "combined_growth_pct"
    else:
        required = [f"Income statement | {row} | {y}" for y in (prev, last) for row in ("Net income", "Total revenue")]
        question = (f"By how many percentage points did the net margin (net income / total revenue) change from "
                    f"{prev} to {last}? (Positive if it rose.)")
        formula = "margin_change_pp"
    answer = compute_answer(formula, [fig[label] for label in required])
    spec = {
        "company": f"{rng.choice(_COMPANY_A)} {rng.choice(_COMPANY_B)}",
        "years": years, "segments": segs, "figures": fig, "peers": peers,
        "filler_seed": rng.randrange(1 << 30),
        "question": question, "required_figures": required, "formula": formula,
        "answer": answer, "tolerance": 0.011, "figure_tolerance": 0.05,
    }
    prompt = (
        f"{render_report(spec)}\n\nQuestion: {question}\nGive the answer to two decimals and cite every figure "
        "you used.\n\nActions (one per turn):\n"
        "SEARCH <words>                          -- report lines containing all the words\n"
        "LOOKUP <table title>                    -- a whole table\n"
        "CITE <table> | <row> | <column> = <value> -- cite a figure\n"
        "ANSWER <value>                          -- final answer"
    )
    return Task(domain=DOMAIN, difficulty=difficulty, task_id=make_task_id(DOMAIN, difficulty, seed, index),
                spec=spec, prompt=prompt)


class DocQAEnv:
    """The ``docqa`` environment (pure Python; no sandbox needed)."""

    domain = DOMAIN

    def __init__(self, *, max_search_lines: int = 20) -> None:
        self.max_search_lines = max_search_lines
        self._task: Task | None = None
        self._report_lines: list[str] = []
        self._cited: list[dict] = []
        self._answer: float | None = None

    def config(self) -> dict:
        return {"max_search_lines": self.max_search_lines}

    def reset(self, task: Task) -> str:
        self._task, self._cited, self._answer = task, [], None
        self._report_lines = render_report(task.spec).splitlines()
        return task.prompt

    def close(self) -> None:
        self._task = None

    def _lookup(self, title: str) -> list[str]:
        want = title.strip().lower()
        for i, line in enumerate(self._report_lines):
            if line.lower().startswith("table: ") and line[7:].lower().split(" (")[0] == want:
                block = [line]
                for nxt in self._report_lines[i + 1:]:
                    if not nxt.startswith("|"):
                        break
                    block.append(nxt)
                return block
        return []

    def step(self, action: str) -> StepOutcome:
        if self._task is None:
            raise EnvironmentFailure("step() before reset()")
        verb, rest, _ = split_action(action)
        spec = self._task.spec
        if verb == "SEARCH" and rest:
            words = rest.lower().split()
            hits = [f"{i + 1}: {ln}" for i, ln in enumerate(self._report_lines) if all(w in ln.lower() for w in words)]
            shown = hits[: self.max_search_lines]
            out = StepOutcome(observation="\n".join(shown) or "no matching lines", tool_name="search",
                              tool_args=dump_json({"query": rest}),
                              tool_result=dump_json({"hits": len(hits), "lines": shown}))
        elif verb == "LOOKUP" and rest:
            block = self._lookup(rest)
            out = StepOutcome(observation="\n".join(block) or f"no table titled {rest!r}", tool_name="lookup",
                              tool_args=dump_json({"table": rest}),
                              tool_result=dump_json({"hits": len(block), "lines": block}))
        elif verb == "CITE" and "=" in rest:
            label, _, value = rest.rpartition("=")
            label = " | ".join(p.strip() for p in label.split("|"))
            out = StepOutcome(observation=f"cited {label} = {value.strip()}", tool_name="cite",
                              tool_args=dump_json({"label": label, "value": value.strip()}))
        elif verb == "ANSWER" and rest:
            self._answer = parse_number(rest)
            out = StepOutcome(observation="answer recorded", tool_name="answer", done=True,
                              tool_args=dump_json({"value": rest, "cited": self._cited}))
        else:
            out = StepOutcome(observation="invalid action; use SEARCH, LOOKUP, CITE <label> = <value> or ANSWER",
                              tool_name="invalid", tool_args=dump_json({"action": action[:200]}))
        out.verdicts = verify_step(DOMAIN, spec, out.recorded(action))
        if out.tool_name == "cite":
            correct = any(v.verifier == "docqa.citation_correct" and v.passed for v in out.verdicts)
            self._cited.append({"label": rest.rpartition("=")[0].strip() and
                                " | ".join(p.strip() for p in rest.rpartition("=")[0].split("|")),
                                "correct": correct})
        return out

    def outcome(self) -> Outcome:
        if self._task is None:
            raise EnvironmentFailure("outcome() before reset()")
        spec = self._task.spec
        ok = numbers_match(self._answer, float(spec["answer"]), float(spec["tolerance"]))
        good = {c["label"] for c in self._cited if c["correct"]}
        covered = sum(1 for r in spec["required_figures"] if r in good)
        frac = covered / len(spec["required_figures"])
        reward = 0.8 * ok + 0.2 * frac
        return Outcome(status="success" if ok and frac == 1.0 else "failure", reward=round(reward, 6),
                       summary=f"answer {'correct' if ok else 'wrong or missing'}; "
                               f"{covered}/{len(spec['required_figures'])} required figures cited")
