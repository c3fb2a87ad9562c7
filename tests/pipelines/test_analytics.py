"""The analyst catalog, `trajpipe query`, the canned reports and the HTML report, over real data.

The dataset: scripted rollouts in the sandboxed environments (two policy
versions, one noisier) through a real Kafka broker, one undecodable message,
the archiver, the Beam trajectory job from Kafka (two micro-batches: two
commits), a rebuild from the archive with another recipe (a second dataset
version), and a published policy. Every report is checked against an
independent polars computation over the files.
"""

from __future__ import annotations

import csv as csv_module
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import duckdb
import polars as pl
import pytest
from deltalake import DeltaTable

from pipelines.catalog import ALL_VERSIONS, CatalogError, open_catalog
from pipelines.delta_tables import app_id
from pipelines.reports import LONG_CONTEXT_TOKENS, REPORTS, run_report
from schemas.manifests import list_dataset_versions, read_dataset_manifests
from streams.archive import read_commits
from tests.helpers import produce_messages, topic_env

# ~2 min on an idle machine (eight `trajpipe` processes build the data); generous under load
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
DOMAINS = "code,math,docqa,tools"


def _trajpipe(env: dict, *args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"trajpipe {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"
    return proc


def _last(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def real(kafka_broker, tmp_path_factory):
    """Real rollouts -> Kafka -> archive + Beam job; returns the paths and the environment."""
    from rollout.model import init_tiny_model
    from trainer.publish import write_policy

    tmp = tmp_path_factory.mktemp("analytics")
    topic = f"analytics-{os.getpid()}"
    env = topic_env(topic, tmp / "spool")
    b = kafka_broker.bootstrap
    tiny = init_tiny_model(tmp / "tiny", seed=0)
    rollout = ["rollout", "--bootstrap", b, "--policy", "scripted", "--model", tiny, "--domains", DOMAINS,
               "--concurrency", 4, "--no-follow-policies"]
    _trajpipe(env, *rollout, "--episodes", 10, "--noise", 0.6, "--policy-version", 0, "--seed", 1)
    _trajpipe(env, *rollout, "--episodes", 10, "--noise", 0.1, "--policy-version", 1, "--policy-lineage", "run-a",
              "--seed", 2)
    produce_messages(b, topic, [(b"junk-episode", b"not an event frame")])
    data, archive = tmp / "datasets", tmp / "archive"
    first = _last(_trajpipe(env, "pipeline", "run", "--source", "kafka", "--bootstrap", b, "--out", data))
    # a second dataset version: the archive rebuilt with another recipe
    _trajpipe(env, "archive", "--bootstrap", b, "--out", archive, "--until-end")
    _trajpipe(env, "pipeline", "run", "--source", "archive", "--archive", archive, "--out", data,
              "--recipe", "verification_shaped")
    # the Kafka job's second micro-batch: commit 2 of the outcome version, the newest commit
    _trajpipe(env, *rollout, "--episodes", 4, "--noise", 0.1, "--policy-version", 1, "--policy-lineage", "run-a",
              "--seed", 3)
    second = _last(_trajpipe(env, "pipeline", "run", "--source", "kafka", "--bootstrap", b, "--out", data))
    _trajpipe(env, "archive", "--bootstrap", b, "--out", archive, "--until-end")
    outcome = next(v for v in list_dataset_versions(data) if v.startswith("outcome-"))
    shaped = next(v for v in list_dataset_versions(data) if v.startswith("verification_shaped-"))
    runs = tmp / "runs"

    def copy_weights(d: Path) -> str:
        for f in tiny.iterdir():
            shutil.copy2(f, d / f.name)
        return "merged"

    write_policy(runs / "run-a" / "policies", version=2, parent_version=1, base_model=tiny, train_step=3,
                 save_weights=copy_weights, lineage="run-a")
    return {"env": env, "data": data, "archive": archive, "runs": runs, "outcome": outcome, "shaped": shaped,
            "episodes": first["episodes"] + second["episodes"], "tmp": tmp, "commits": (first, second)}


def _files(root: Path, table: str, version: str) -> pl.LazyFrame:
    """Independent reader: the version's files by directory glob (all committed here: no job is running)."""
    return pl.scan_parquet(str(root / table / f"recipe={version}" / "**" / "*.parquet"), hive_partitioning=True)


def test_catalog_views_snapshot_versions_and_polars(real):
    data, archive, outcome, shaped = real["data"], real["archive"], real["outcome"], real["shaped"]
    cat = open_catalog(data=data, archive=archive, runs=[real["runs"]])
    assert cat.version == outcome  # the version committed most recently
    assert {"events", "steps", "trajectories", "dead_letters", "incomplete", "policies", "commits", "commit_files",
            "dataset_versions", "catalog_info"} <= set(cat.views)
    con = cat.connect()
    traj = _files(data, "trajectories", outcome).collect()
    assert con.sql("select count(*) from trajectories").fetchall()[0][0] == traj.height == real["episodes"] == 24
    for name in ("steps", "trajectories", "dead_letters", "events"):  # DuckDB view == polars LazyFrame
        n_duck = con.sql(f"select count(*) from {name}").fetchall()[0][0]
        assert n_duck == cat.scan(name).select(pl.len()).collect().item() > 0, name
    assert con.sql("select count(*) from dead_letters").fetchall()[0][0] == 1
    n_events = pl.scan_parquet(str(archive / "bucket=*" / "*.parquet")).select(pl.len()).collect().item()
    assert con.sql("select count(*) from events").fetchall()[0][0] == n_events
    assert con.sql("select version, parent_version, lineage from policies").fetchall() == [(2, 1, "run-a")]
    commits = con.sql("select version, commit from commits where source = 'dataset' order by all").fetchall()
    assert commits == sorted([(outcome, 1), (outcome, 2), (shaped, 1)])
    # the views read exactly the files the manifests name
    named = {str(data / f.path) for m in read_dataset_manifests(data, outcome) for f in m.files
             if f.path.startswith("trajectories/")}
    assert set(cat.tables["trajectories"].files) == named

    # as of commit 1: only the first micro-batch
    first = open_catalog(data=data, as_of=1)
    assert first.connect().sql("select count(*) from trajectories").fetchall()[0][0] == real["commits"][0]["episodes"]
    # time travel: as of the moment commit 1 was made is commit 1; before any commit is an error naming the first
    m1, m2 = read_dataset_manifests(data, outcome)
    assert open_catalog(data=data, version=outcome, as_of=m1.created_at).as_of == 1
    with pytest.raises(CatalogError, match="no commit at or before .* its first was made"):
        open_catalog(data=data, version=outcome, as_of=m1.created_at - timedelta(seconds=1))
    # the Delta tables hold the same rows as the manifests' files, one transaction per commit
    delta = DeltaTable(str(data / "trajectories"))
    assert delta.transaction_version(app_id(outcome)) == 2 and delta.transaction_version(app_id(shaped)) == 1
    every = open_catalog(data=data, version=ALL_VERSIONS).connect().sql("select count(*) from trajectories")
    assert delta.to_pyarrow_dataset().count_rows() == every.fetchall()[0][0]
    # versions: by recipe name, all side by side, unknown ones named
    assert open_catalog(data=data, version="verification_shaped").version == shaped
    both = open_catalog(data=data, version=ALL_VERSIONS).connect()
    assert both.sql("select count(distinct recipe), count(*) from trajectories").fetchall()[0] == (
        2, 24 + real["commits"][0]["episodes"])
    with pytest.raises(CatalogError, match="versions: .*outcome-"):
        open_catalog(data=data, version="nope")
    with pytest.raises(CatalogError, match=r"commits are 1\.\.2"):
        open_catalog(data=data, as_of=3)

    # a commit whose manifest is written but whose files are not all renamed yet is not shown
    moved = next(f for f in m2.files if f.path.startswith("trajectories/"))
    (data / moved.staged).parent.mkdir(parents=True, exist_ok=True)
    os.replace(data / moved.path, data / moved.staged)
    try:
        half = open_catalog(data=data)
        assert half.tables["trajectories"].commit == 1
        n_half = half.connect().sql("select count(*) from trajectories").fetchall()[0][0]
        assert n_half == real["commits"][0]["episodes"]
        assert not any(str(data / f.path) in half.tables["steps"].files for f in m2.files)
    finally:
        os.replace(data / moved.staged, data / moved.path)
        shutil.rmtree(data / "_staging", ignore_errors=True)


def _pl_pass_rate(t: pl.DataFrame) -> pl.DataFrame:
    judged = t.filter(pl.col("complete") & pl.col("termination").is_in(["done", "max_steps"]))
    return (judged.group_by("domain", "policy_version")
            .agg(pl.len().alias("episodes"), (pl.col("status") == "success").sum().alias("passed"),
                 pl.col("outcome_reward").mean().alias("mean_reward"))
            .with_columns((pl.col("passed") / pl.col("episodes")).alias("pass_rate"))
            .sort("domain", "policy_version"))


def _rows(con, name, views) -> pl.DataFrame:
    return pl.from_arrow(run_report(con, name, views))


def test_every_report_matches_polars(real):
    data, outcome = real["data"], real["outcome"]
    cat = open_catalog(data=data, archive=real["archive"], runs=[real["runs"]])
    con, views = cat.connect(), cat.views
    t = _files(data, "trajectories", outcome).collect()
    s = _files(data, "steps", outcome).collect()
    assert set(REPORTS) == {"pass_rate", "rewards", "policy_lag", "token_cost", "failures", "dead_letters",
                            "throughput", "latency", "commits"}

    got = _rows(con, "pass_rate", views)
    want = _pl_pass_rate(t)
    assert got["source"].unique().to_list() == ["rollouts"] and got.height == want.height
    for col in ("domain", "policy_version", "episodes", "passed"):
        assert got[col].to_list() == want[col].to_list(), col
    for col in ("pass_rate", "mean_reward"):
        assert got[col].to_list() == pytest.approx(want[col].to_list()), col
    # the scripted policy with less noise passes more (v1) than the noisy one (v0)
    by_version = want.group_by("policy_version").agg(pl.col("passed").sum() / pl.col("episodes").sum()).sort(
        "policy_version")
    assert by_version["passed"][1] > by_version["passed"][0]

    got = _rows(con, "rewards", views)
    judged = t.filter(pl.col("complete") & pl.col("termination").is_in(["done", "max_steps"]))
    for metric, frame in (("outcome_reward", judged), ("episode_return", judged),
                          ("normalized_advantage", s.filter(pl.col("trainable")))):
        want = frame.group_by("domain").agg(pl.len().alias("n"), pl.col(metric).mean().alias("mean"),
                                            pl.col(metric).std(ddof=0).alias("std"),
                                            pl.col(metric).median().alias("p50"),
                                            pl.col(metric).max().alias("max")).sort("domain")
        g = got.filter(pl.col("metric") == metric).sort("domain")
        assert g["domain"].to_list() == want["domain"].to_list() and g["n"].to_list() == want["n"].to_list()
        for col in ("mean", "std", "p50", "max"):
            assert g[col].to_list() == pytest.approx(want[col].to_list(), abs=1e-9), (metric, col)

    got = _rows(con, "policy_lag", views)  # reference: the published v2
    lag = s.filter(pl.col("trainable")).with_columns((2 - pl.col("policy_version")).alias("lag"))
    want = lag.group_by("domain").agg(pl.len().alias("samples"), pl.col("lag").mean().alias("mean_lag"),
                                      pl.col("lag").max().alias("max_lag")).sort("domain")
    assert got["reference_version"].unique().to_list() == [2]
    assert got["samples"].to_list() == want["samples"].to_list()
    assert got["mean_lag"].to_list() == pytest.approx(want["mean_lag"].to_list())
    assert got["max_lag"].to_list() == want["max_lag"].to_list() == [2] * want.height

    got = _rows(con, "token_cost", views)
    tok = (s.with_columns(pl.col("observation_token_ids").list.len().alias("obs"),
                          pl.col("action_token_ids").list.len().alias("act"))
           .sort("episode_id", "step_index")
           .with_columns(((pl.col("obs") + pl.col("act")).cum_sum().over("episode_id") - pl.col("act"))
                         .alias("context")))
    want = tok.group_by("domain").agg(
        pl.col("episode_id").n_unique().alias("episodes"), pl.len().alias("steps"),
        pl.col("obs").sum().alias("prompt_tokens"), pl.col("act").sum().alias("generated_tokens"),
        pl.col("context").sum().alias("context_tokens"), pl.col("context").max().alias("max_context"),
        (pl.col("context") >= LONG_CONTEXT_TOKENS).mean().alias("long_context_share"),
        (pl.col("obs") + pl.col("act")).filter(pl.col("step_index") > 0).mean().alias("context_growth_per_step"),
    ).sort("domain")
    for col in ("domain", "episodes", "steps", "prompt_tokens", "generated_tokens", "context_tokens", "max_context"):
        assert got[col].to_list() == want[col].to_list(), col
    # the stored counts of every real step row are the token lists' lengths and the stream before the action
    stored = [(pl.col(a) == pl.col(b)).all() for a, b in
              (("observation_tokens", "obs"), ("action_tokens", "act"), ("context_tokens", "context"))]
    assert tok.select(stored).row(0) == (True, True, True)
    assert tok["context_tokens"].max() > tok["observation_tokens"].max()  # multi-step episodes: context grows
    for col in ("long_context_share", "context_growth_per_step"):
        assert got[col].to_list() == pytest.approx(want[col].to_list()), col
    assert (got["prompt_tokens"] > 0).all() and (got["generated_tokens"] > 0).all()

    got = _rows(con, "failures", views)
    failed = judged.filter(pl.col("status") != "success").group_by("domain", "status").len().sort("domain", "status")
    g = got.filter(pl.col("kind") == "failed").sort("domain", "reason")
    assert g["domain"].to_list() == failed["domain"].to_list() and g["episodes"].to_list() == failed["len"].to_list()
    infra = t.filter(pl.col("complete") & ~pl.col("termination").is_in(["done", "max_steps"]))
    assert got.filter(pl.col("kind") == "infrastructure")["episodes"].sum() == infra.height
    assert got.filter(pl.col("kind") == "incomplete")["episodes"].sum() == t.filter(~pl.col("complete")).height

    got = _rows(con, "dead_letters", views)
    dl = _files(data, "dead_letters", outcome).collect()
    want = dl.group_by("reason").len().sort("reason")
    g = got.filter(pl.col("source") == "dead_letters").sort("reason")
    assert g["reason"].to_list() == want["reason"].to_list() and g["messages"].to_list() == want["len"].to_list()
    assert g["messages"].sum() == 1

    got = _rows(con, "throughput", views)
    assert got["episodes"].sum() == t.height and got["events"].sum() == t["num_events"].sum()
    span = (t["last_event_time"].max() - t["last_event_time"].min()).total_seconds()
    bucket_s = max(1.0, -(-span // 1) / 20)
    want = (t.with_columns(((pl.col("last_event_time") - t["last_event_time"].min()).dt.total_microseconds()
                            / 1e6 / bucket_s).floor().cast(pl.Int64).alias("bucket"))
            .group_by("bucket").agg(pl.len().alias("episodes"), pl.col("num_events").sum().alias("events"))
            .sort("bucket"))
    assert got["bucket"].to_list() == list(range(want["bucket"].max() + 1))  # empty buckets are rows of 0
    busy = got.filter(pl.col("episodes") > 0)
    assert busy["bucket"].to_list() == want["bucket"].to_list()
    assert busy["episodes"].to_list() == want["episodes"].to_list()
    assert busy["events_per_s"].to_list() == pytest.approx((want["events"] / bucket_s).to_list())

    got = _rows(con, "latency", views)
    commits = cat.scan("commit_files").filter(pl.col("table") == "trajectories").collect()
    files = pl.scan_parquet(str(data / "trajectories" / f"recipe={outcome}" / "**" / "*.parquet"),
                            include_file_paths="filename", hive_partitioning=True).collect()
    lat = (files.join(commits, on="filename")
           .with_columns(((pl.col("created_at") - pl.col("last_event_time")).dt.total_microseconds() / 1e6)
                         .alias("latency_s"))
           .group_by("commit").agg(pl.len().alias("episodes"), pl.col("latency_s").max().alias("max_s"),
                                   pl.col("latency_s").median().alias("p50_s")).sort("commit"))
    assert got["commit"].to_list() == lat["commit"].to_list() == [1, 2]
    assert got["episodes"].to_list() == lat["episodes"].to_list()
    assert got["max_s"].to_list() == pytest.approx(lat["max_s"].to_list())
    assert got["p50_s"].to_list() == pytest.approx(lat["p50_s"].to_list())
    assert (got["p50_s"] > 0).all()

    got = _rows(con, "commits", views)
    n_archive = len(read_commits(real["archive"]))
    assert got.filter(pl.col("source") == "dataset").height == 3
    assert got.filter(pl.col("source") == "archive").height == n_archive
    n_events = con.sql("select count(*) from events").fetchall()[0][0]
    assert got.filter(pl.col("source") == "archive")["rows"].sum() == n_events


def test_query_catalog_and_report_commands(real):
    env, data, archive = real["env"], real["data"], real["archive"]
    out = _trajpipe(env, "query", "--data", data, "--format", "json",
                    "select domain, count(*) n from trajectories group by domain order by domain")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    want = _files(data, "trajectories", real["outcome"]).group_by("domain").len().sort("domain").collect()
    assert [(r["domain"], r["n"]) for r in rows] == list(zip(want["domain"], want["len"]))
    csv = _trajpipe(env, "query", "--data", data, "--version", "verification_shaped", "--format", "csv",
                    "select recipe, count(*) n from trajectories group by 1").stdout
    assert list(csv_module.reader(csv.splitlines())) == [["recipe", "n"], [real["shaped"], "20"]]
    pq_out = real["tmp"] / "q.parquet"
    counts = _last(_trajpipe(env, "query", "--data", data, "--as-of", 1, "--format", "parquet", "--out", pq_out,
                             "select * from trajectories"))
    assert counts["rows"] == real["commits"][0]["episodes"] == pl.read_parquet(pq_out).height

    # errors name what exists: one `error:` line, exit 2 (the command) ...
    for args, needle in (
        (("--data", data, "select * from nope"), "views: catalog_info, commit_files, commits"),
        (("--data", data, "selec 1"), "query failed: Parser Error"),
        (("--data", real["tmp"] / "missing", "select 1"), "holds: "),
    ):
        bad = _trajpipe(env, "query", *args, check=False)
        assert bad.returncode == 2 and needle in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1 and bad.stderr.startswith("error: "), bad.stderr
    # ... with the same AnalyticsError the command reports (the other cases, in-process)
    from trajpipe.analytics import AnalyticsError, query_command

    kw = dict(data=data, archive=None, runs=[], version=None, as_of=None, fmt="table", out=None)
    for change, needle in (({"data": archive}, "holds no dataset"),
                           ({"version": "nope"}, f"versions: {real['outcome']} (2 commits)"),
                           ({"as_of": 9}, "its commits are 1..2"), ({"as_of": "yesterday"}, "an ISO 8601 time"),
                           ({"as_of": "2020-01-01T00:00:00Z"}, "no commit at or before 2020-01-01T00:00:00+00:00"),
                           ({"fmt": "xml"}, "table, csv, json, parquet"),
                           ({"fmt": "parquet"}, "give `--out FILE.parquet`")):
        with pytest.raises(AnalyticsError, match=re.escape(needle)):
            query_command("select 1", **{**kw, **change})

    listed = _trajpipe(env, "report", "list", "--format", "json").stdout.splitlines()
    assert {json.loads(x)["report"] for x in listed} == {*REPORTS, "html"}
    doc = json.loads(_trajpipe(env, "report", "pass_rate", "--data", data, "--format", "json").stdout)
    con = open_catalog(data=data).connect()
    want = _pl_pass_rate(pl.from_arrow(con.sql("select * from trajectories").to_arrow_table()))
    assert [(r["domain"], r["policy_version"], r["passed"]) for r in doc["rows"]] == list(
        zip(want["domain"], want["policy_version"], want["passed"]))
    bad = _trajpipe(env, "report", "nope", "--data", data, check=False)
    assert bad.returncode == 2 and "reports: pass_rate, rewards" in bad.stderr

    # the catalog file opens in the DuckDB CLI from PyPI
    db = real["tmp"] / "catalog.duckdb"
    counts = _last(_trajpipe(env, "catalog", "--data", data, "--archive", archive, "--runs", real["runs"], "--db", db))
    assert counts["version"] == real["outcome"] and counts["tables"]["trajectories"] >= 2
    cli = shutil.which("duckdb", path=str(Path(sys.executable).parent))
    assert cli, "the duckdb CLI (pip duckdb-cli, requirements.in) is not installed"
    got = subprocess.run([cli, "-csv", "-noheader", str(db), "-c",
                          "select domain, count(*) from trajectories group by 1 order by 1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert got == [f"{d},{n}" for d, n in want_counts(data, real["outcome"]).items()]
    ev = subprocess.run([cli, "-csv", "-noheader", str(db), "-c", "select count(*) from events; "
                         "select count(*) from policies; select count(*) from commits"],
                        capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert int(ev[0]) > 0 and ev[1] == "1" and int(ev[2]) >= 4
    # rewriting the catalog picks up the current snapshot; as-of pins an earlier one
    _trajpipe(env, "catalog", "--data", data, "--as-of", 1, "--db", db)
    one = duckdb.connect(str(db), read_only=True).sql("select count(*) from trajectories").fetchall()[0][0]
    assert one == real["commits"][0]["episodes"]


def want_counts(data: Path, version: str) -> dict[str, int]:
    t = _files(data, "trajectories", version).group_by("domain").len().sort("domain").collect()
    return dict(zip(t["domain"], t["len"]))


def test_html_report_renders_every_chart_in_headless_chromium(real):
    from pipelines.report_html import CHARTS

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is missing: `make system-packages` installs it"
    page = real["tmp"] / "report.html"
    counts = _last(_trajpipe(real["env"], "report", "html", "--data", real["data"], "--archive", real["archive"],
                             "--runs", real["runs"], "--out", page))
    assert counts["charts"] == len(CHARTS) and counts["trajectories"] == 24
    text = page.read_text()
    # self-contained: nothing loaded from elsewhere (plotly.js is inline)
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=", text), "an external resource"
    profile = real["tmp"] / "chromium-profile"
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
             "--virtual-time-budget=20000", "--window-size=1200,4000"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180,
                         check=True).stdout
    # each chart's part of the rendered DOM: from its div to the end of its <section>
    segments = {}
    for chart in CHARTS:
        start = dom.index(f'id="{chart}"')
        segments[chart] = dom[start:dom.index("</section>", start)]
    for chart, seg in segments.items():
        assert seg.count("<svg") >= 1, f"{chart}: no SVG drawn"
        drawn = seg.count('class="trace ') + seg.count('class="hm"') + seg.count('class="table"')
        assert drawn >= 1, f"{chart}: no data drawn (no trace, heatmap or table)"
    assert "main-svg" in dom and dom.count('class="plotly-graph-div') == len(CHARTS)
    shot = real["tmp"] / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=180, check=True)
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # charts, not a blank page
    assert max(n for n, _ in colors) < 0.98 * img.width * img.height


def test_duckdb_polars_delta_and_spark_count_the_same(real):
    """Issue 14's acceptance: `trajpipe query` (DuckDB), polars `scan_delta` and pyspark return the same counts.

    Spark reads the tables' Parquet files (its Parquet reader discovers the ``recipe=``/``domain=``
    partitions and skips ``_delta_log``); polars reads the Delta snapshot, newest and as of the Delta
    version that holds the first commit of the outcome version (``table_versions_at``).
    """
    from pyspark.sql import SparkSession

    from pipelines.delta_tables import table_versions_at

    env, data = real["env"], real["data"]
    spark = (SparkSession.builder.master("local[1]").appName("trajpipe-counts").config("spark.ui.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "512m").getOrCreate())
    try:
        for table in ("steps", "trajectories"):
            sql = f"select recipe, domain, count(*) n from {table} group by all order by all"
            by_duckdb = [(r["recipe"], r["domain"], r["n"]) for r in map(json.loads, _trajpipe(
                env, "query", "--data", data, "--version", ALL_VERSIONS, "--format", "json", sql).stdout.splitlines())]
            by_polars = sorted(pl.scan_delta(str(data / table)).group_by("recipe", "domain").len().collect().iter_rows())
            by_spark = sorted((r["recipe"], r["domain"], r["count"]) for r in
                              spark.read.parquet(str(data / table)).groupBy("recipe", "domain").count().collect())
            assert by_duckdb == by_polars == by_spark, table
            assert {r for r, _, _ in by_duckdb} == {real["outcome"], real["shaped"]}
        # time travel: the outcome version's first commit, by commit number (DuckDB) and by Delta version (polars)
        at = table_versions_at(data, real["outcome"], 1)["trajectories"]
        first = pl.scan_delta(str(data / "trajectories"), version=at).filter(pl.col("recipe") == real["outcome"])
        as_of = _last(_trajpipe(env, "query", "--data", data, "--as-of", 1, "--format", "parquet",
                                "--out", real["tmp"] / "as-of.parquet", "select * from trajectories"))
        assert as_of["rows"] == first.select(pl.len()).collect().item() == real["commits"][0]["episodes"]
    finally:
        spark.stop()
