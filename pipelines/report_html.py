"""``trajpipe report html``: the canned reports as one self-contained HTML file with Plotly charts.

The file needs no server and no network: plotly.js is embedded once, inline,
and every chart is a ``<div class="plotly-graph-div">`` drawn by it into SVG
(and canvas, for WebGL traces) when the page loads. Open it in any browser::

    trajpipe report html --data data/datasets --archive data/archive --runs runs --out report.html

Charts: mean reward and pass rate per domain over policy versions (lines), a
domain x policy version pass-rate heatmap, token cost per domain (bars:
prompt vs generated), the failure breakdown by domain and reason (stacked
bars), dead letters and late events by reason, throughput over time, and the
commit history with its counts (table).
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import pyarrow as pa
from plotly.offline import get_plotlyjs

from pipelines.catalog import Catalog
from pipelines.reports import run_report
from schemas import locations as loc

__all__ = ["write_html_report", "CHARTS"]

#: Chart ids, in page order (each is one ``plotly-graph-div``).
CHARTS = ("reward_by_version", "pass_rate_by_version", "pass_rate_heatmap", "token_cost", "failures",
          "dead_letters", "throughput", "commits")


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return table.to_pylist()


def _lines(rows: list[dict], y: str, title: str, y_title: str) -> go.Figure:
    fig = go.Figure()
    for domain in sorted({r["domain"] for r in rows}):
        pts = sorted((r["policy_version"], r[y]) for r in rows if r["domain"] == domain)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=domain))
    fig.update_layout(title=title, xaxis_title="policy version", yaxis_title=y_title)
    fig.update_xaxes(type="category")
    return fig


def _heatmap(rows: list[dict]) -> go.Figure:
    domains = sorted({r["domain"] for r in rows})
    versions = sorted({r["policy_version"] for r in rows})
    cell = {(r["domain"], r["policy_version"]): r["pass_rate"] for r in rows}
    z = [[cell.get((d, v)) for v in versions] for d in domains]
    fig = go.Figure(go.Heatmap(z=z, x=[str(v) for v in versions], y=domains, zmin=0, zmax=1, colorscale="Viridis",
                               text=[[("" if c is None else f"{c:.2f}") for c in row] for row in z],
                               texttemplate="%{text}", colorbar={"title": "pass rate"}))
    fig.update_layout(title="Pass rate: domain x policy version", xaxis_title="policy version")
    return fig


def _token_cost(rows: list[dict]) -> go.Figure:
    domains = [r["domain"] for r in rows]
    fig = go.Figure([go.Bar(x=domains, y=[r["prompt_tokens"] for r in rows], name="prompt (observation) tokens"),
                     go.Bar(x=domains, y=[r["generated_tokens"] for r in rows], name="generated tokens")])
    fig.update_layout(title="Token cost per domain", barmode="group", yaxis_title="tokens")
    return fig


def _failures(rows: list[dict]) -> go.Figure:
    fig = go.Figure()
    domains = sorted({r["domain"] for r in rows})
    for kind, reason in sorted({(r["kind"], r["reason"] or "") for r in rows}):
        n = {r["domain"]: r["episodes"] for r in rows if r["kind"] == kind and (r["reason"] or "") == reason}
        fig.add_trace(go.Bar(x=domains, y=[n.get(d, 0) for d in domains], name=f"{kind}: {reason}"))
    fig.update_layout(title="Failures by domain and reason", barmode="stack", yaxis_title="episodes")
    return fig


def _dead_letters(rows: list[dict]) -> go.Figure:
    fig = go.Figure(go.Bar(x=[f"{r['source']}: {r['reason']}" for r in rows], y=[r["messages"] for r in rows]))
    fig.update_layout(title="Dead letters and late events by reason" + ("" if rows else " (none)"),
                      yaxis_title="messages")
    return fig


def _throughput(rows: list[dict]) -> go.Figure:
    x = [r["bucket_start"] for r in rows]
    fig = go.Figure([go.Scatter(x=x, y=[r["events_per_s"] for r in rows], name="events/s", mode="lines+markers"),
                     go.Scatter(x=x, y=[r["episodes_per_s"] for r in rows], name="episodes/s", mode="lines+markers",
                                yaxis="y2")])
    fig.update_layout(title="Throughput (by the episodes' last event time)", yaxis_title="events/s",
                      yaxis2={"title": "episodes/s", "overlaying": "y", "side": "right"})
    return fig


def _commits(rows: list[dict]) -> go.Figure:
    cols = ["source", "version", "commit", "created_at", "input", "files", "rows", "episodes", "steps", "dead_letters"]
    cells = [[("" if r[c] is None else str(r[c])[:19] if c == "created_at" else str(r[c])) for r in rows]
             for c in cols]
    fig = go.Figure(go.Table(header={"values": cols}, cells={"values": cells}))
    fig.update_layout(title=f"Commits ({len(rows)})")
    return fig


def _figures(tables: dict[str, pa.Table]) -> dict[str, go.Figure]:
    pr = _rows(tables["pass_rate"])
    return {
        "reward_by_version": _lines(pr, "mean_reward", "Mean outcome reward per domain over policy versions",
                                    "mean reward"),
        "pass_rate_by_version": _lines(pr, "pass_rate", "Pass rate per domain over policy versions", "pass rate"),
        "pass_rate_heatmap": _heatmap(pr),
        "token_cost": _token_cost(_rows(tables["token_cost"])),
        "failures": _failures(_rows(tables["failures"])),
        "dead_letters": _dead_letters(_rows(tables["dead_letters"])),
        "throughput": _throughput(_rows(tables["throughput"])),
        "commits": _commits(_rows(tables["commits"])),
    }


def write_html_report(catalog: Catalog, out: Path | str) -> dict[str, Any]:
    """Run the reports the charts need and write the page (plotly.js inline) to ``out``.

    Args:
        catalog: the opened catalog (pipelines/catalog.py).
        out: the HTML file to write.

    Returns:
        Counts: ``{"out": path, "charts": n, "bytes": size, ...}``.

    Raises:
        ReportError: the catalog lacks a view a chart needs (e.g. no dataset at all).
    """
    con = catalog.connect()
    views = catalog.views
    tables = {name: run_report(con, name, views)
              for name in ("pass_rate", "token_cost", "failures", "dead_letters", "throughput", "commits")}
    figures = _figures(tables)
    counts = {name: con.sql(f"select count(*) from {name}").fetchall()[0][0]
              for name in ("trajectories", "steps", "events", "dead_letters", "late_events", "evaluations")
              if name in views}
    divs = []
    for chart_id in CHARTS:
        figures[chart_id].update_layout(template="plotly_white", height=420, margin={"t": 60})
        divs.append(f'<section><h2>{html.escape(chart_id)}</h2>'
                    + figures[chart_id].to_html(full_html=False, include_plotlyjs=False, div_id=chart_id,
                                                config={"displaylogo": False, "staticPlot": False}) + "</section>")
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in counts.items())
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>trajpipe report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} table.counts td,table.counts th{{padding:2px 12px;
text-align:left}}</style>
<script type="text/javascript">{get_plotlyjs()}</script></head>
<body><h1>trajpipe report</h1>
<p>dataset {html.escape(str(catalog.data))} &middot; version {html.escape(str(catalog.version))}
&middot; archive {html.escape(str(catalog.archive))} &middot; written {when}</p>
<table class="counts">{summary}</table>
<script type="application/json" id="trajpipe-report-data">{html.escape(json.dumps(
        {"charts": list(CHARTS), "counts": counts}))}</script>
{''.join(divs)}
</body></html>
"""
    data = page.encode("utf-8")
    loc.write_atomic(out, data)  # locally tmp + rename; on S3 one PUT (the object appears whole)
    return {"out": str(out), "charts": len(CHARTS), "bytes": len(data), **counts}

