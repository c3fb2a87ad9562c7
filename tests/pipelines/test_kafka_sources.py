"""ReadKafkaRange / ReadKafkaStream against real brokers (Kafka and Tansu) on real runners.

Each check compares the ``(partition, offset, value)`` triples a pipeline read
with what the producer was acknowledged for: every record of the range exactly
once, nothing outside it.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner, fn_runner
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms import environments
from apache_beam.transforms.window import FixedWindows
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from pipelines.runners import runner_options
from pipelines.sources_kafka import ReadKafkaRange, ReadKafkaStream, _kept_reader, _ReadWholeRangeFn
from pipelines.types import RawRecords
from schemas.codec import encode_event
from streams.broker import BrokerInfo
from streams.config import KafkaConnection
from streams.consumer import ReadStalledError, end_offsets
from streams.fetch import PartitionReader
from streams.synth import generate_episodes

PARTITIONS = 3
EPISODES = 40  # ~400 events of a few KB each


def _create_topic(conn: KafkaConnection, topic: str, partitions: int) -> None:
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()


def _produce(conn: KafkaConnection, topic: str, messages: list[tuple[bytes, bytes, int | None]]) -> list[tuple[int, int, bytes]]:
    """Send (key, value, partition or None); return the acknowledged (partition, offset, value)."""
    producer = KafkaProducer(**conn.client_kwargs(), acks="all", linger_ms=20, batch_size=256 << 10)
    try:
        futures = [(producer.send(topic, key=k, value=v, partition=p), v) for k, v, p in messages]
        producer.flush(timeout=60)
        return [(f.get(timeout=30).partition, f.get(timeout=30).offset, v) for f, v in futures]
    finally:
        producer.close(timeout=10)


def _triples(rr: RawRecords) -> list[tuple[int, int, bytes]]:
    return [(rr.partition, o, v) for o, v in zip(rr.offsets, rr.values)]


@pytest.fixture(scope="module", params=["kafka", "tansu"])
def broker(request: pytest.FixtureRequest) -> BrokerInfo:
    return request.getfixturevalue(f"{request.param}_broker")


@pytest.fixture(scope="module")
def filled_topic(broker: BrokerInfo) -> tuple[KafkaConnection, str, list[tuple[int, int, bytes]]]:
    """A 3-partition topic holding synthetic episodes (multi-record batches), and what was acked."""
    conn = KafkaConnection(bootstrap_servers=broker.bootstrap, client_id="test-sources")
    topic = f"test.sources.{broker.engine}.{time.monotonic_ns()}"
    _create_topic(conn, topic, PARTITIONS)
    messages = [(ev.episode_id.encode(), encode_event(ev), None)
                for ep in generate_episodes(EPISODES, seed=3) for ev in ep]
    acked = _produce(conn, topic, messages)
    return conn, topic, sorted(acked)


def _check_read(conn: KafkaConnection, topic: str, ranges, expected: list, **kw) -> None:
    """Run ReadKafkaRange on FnApiRunner; its (partition, offset, value) multiset must equal ``expected``."""
    with beam.Pipeline(runner=FnApiRunner()) as p:
        triples = p | "ReadKafka" >> ReadKafkaRange(conn, topic, ranges, **kw) | beam.FlatMap(_triples)
        assert_that(triples, equal_to(expected))


@pytest.mark.integration
def test_full_range_reads_every_acked_record_once(filled_topic):
    conn, topic, acked = filled_topic
    assert end_offsets(conn, topic) == {p: sum(1 for a in acked if a[0] == p) for p in range(PARTITIONS)}
    # Small batches and initial splits: many restrictions per partition, all stitched back exactly.
    _check_read(conn, topic, None, acked, batch_size=17, split_records=40)


@pytest.mark.integration
def test_middle_and_empty_ranges(filled_topic):
    conn, topic, acked = filled_topic
    ends = end_offsets(conn, topic)
    ranges = [(0, 5, ends[0] - 7), (1, 3, 3), (2, ends[2] - 1, ends[2])]
    expected = [a for a in acked if (a[0] == 0 and 5 <= a[1] < ends[0] - 7) or (a[0] == 2 and a[1] == ends[2] - 1)]
    assert 0 < len(expected) < len(acked)
    _check_read(conn, topic, ranges, expected, batch_size=50)
    _check_read(conn, topic, [(1, 4, 4)], [])
    _check_read(conn, topic, [], [])


@pytest.mark.integration
def test_dynamic_splits_lose_and_duplicate_nothing(filled_topic, tmp_path):
    """The runner splits the running restriction twice mid-read; the residuals are read elsewhere."""
    conn, topic, acked = filled_topic
    ends = end_offsets(conn, topic)
    # Files, not threading.Events: the DoFn runs on an unpickled copy of this closure.
    first_batch, split_done = tmp_path / "first-batch", tmp_path / "split-done"
    results: list = []

    def wait_for(path: Path, timeout_s: float = 30) -> bool:
        deadline = time.monotonic() + timeout_s
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return path.exists()

    def split_manager(num_elements):
        yield  # start the bundle
        assert wait_for(first_batch)
        results.append((yield 0.5))
        results.append((yield 0.3))
        split_done.touch()

    def pause_after_first(rr: RawRecords):
        first_batch.touch()
        wait_for(split_done)
        return rr

    # A gRPC worker, so split requests reach it while it processes the bundle.
    runner = FnApiRunner(default_environment=environments.EmbeddedPythonGrpcEnvironment.default())
    with fn_runner.split_manager("ReadKafka/ReadRecords/Process", split_manager):
        with beam.Pipeline(runner=runner) as p:
            triples = (p | "ReadKafka" >> ReadKafkaRange(conn, topic, [(0, 0, ends[0])], batch_size=10,
                                                         split_records=None)
                       | beam.Map(pause_after_first) | beam.FlatMap(_triples))
            assert_that(triples, equal_to([a for a in acked if a[0] == 0]))
    assert any(r is not None and r.residual_roots for r in results), results


@pytest.mark.integration
def test_range_past_the_end_raises_instead_of_hanging(filled_topic):
    conn, topic, _ = filled_topic
    end = end_offsets(conn, topic)[1]
    t0 = time.monotonic()
    with pytest.raises(Exception, match="made no progress") as err:
        _check_read(conn, topic, [(1, end - 2, end + 5)], [], stall_timeout_s=2, poll_timeout_ms=200)
    assert time.monotonic() - t0 < 60
    assert "ReadStalledError" in repr(err.value) or isinstance(err.value, ReadStalledError)


def test_bad_arguments_name_the_parameter():
    conn = KafkaConnection(bootstrap_servers="127.0.0.1:1")
    with pytest.raises(ValueError, match="`ranges` has two ranges for partition 0"):
        ReadKafkaRange(conn, "t", [(0, 0, 5), (0, 5, 9)])
    with pytest.raises(ValueError, match="start <= end"):
        ReadKafkaRange(conn, "t", [(0, 9, 5)])
    with pytest.raises(ValueError, match="`batch_size`"):
        ReadKafkaRange(conn, "t", [], batch_size=0)
    with pytest.raises(ValueError, match="`stop_after_s`"):
        ReadKafkaStream(conn, "t", partitions=[0], stop_after_s=0)
    with pytest.raises(ValueError, match="`start_offsets` names partitions \\[7\\]"):
        ReadKafkaStream(conn, "t", {7: 0}, partitions=[0])


class _WriteFiles(beam.DoFn):
    """Write each element as one small file (visible to the test while the job runs)."""

    def __init__(self, out: str, fmt) -> None:
        self._out = out
        self._fmt = fmt

    def process(self, element, window=beam.DoFn.WindowParam):
        text = self._fmt(element, window)
        path = Path(self._out) / f"{abs(hash(text))}-{time.monotonic_ns()}.txt"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.rename(path)


def _lines(d: Path) -> list[str]:
    return [line for f in sorted(d.glob("*.txt")) for line in f.read_text().splitlines()]


def _window_total(d: Path) -> int:
    return sum(int(line.split()[1]) for line in _lines(d))


@pytest.mark.integration
@pytest.mark.slow
# Beam's LOOPBACK worker logs a CANCELLED gRPC stream from a thread when the runner hangs up.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stream_on_prism_sees_live_records_and_advances_the_watermark(tansu_broker, tmp_path):
    """Phase 1 is read and its event-time windows fire while the job runs; phase 2, produced
    afterwards, is read too; the job stops by itself at the stop offsets."""
    conn = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, client_id="test-stream")
    topic = f"test.stream.{time.monotonic_ns()}"
    _create_topic(conn, topic, 2)
    n1, n2 = 30, 20  # per partition
    phase1 = [(f"k{i}".encode(), f"one-{p}-{i}".encode(), p) for p in range(2) for i in range(n1)]
    phase2 = [(f"k{i}".encode(), f"two-{p}-{i}".encode(), p) for p in range(2) for i in range(n2)]
    acked = _produce(conn, topic, phase1)
    records_dir, windows_dir, batches_dir = tmp_path / "records", tmp_path / "windows", tmp_path / "batches"
    records_dir.mkdir()
    windows_dir.mkdir()
    batches_dir.mkdir()

    p = beam.Pipeline(options=runner_options("PrismRunner", "stream", []))
    batches = p | ReadKafkaStream(conn, topic, batch_size=16, poll_timeout_ms=100, idle_watermark_lag_s=0.5,
                                  stop_offsets={0: n1 + n2, 1: n1 + n2},
                                  stop_after_s=120)
    _ = (batches | "Triples" >> beam.FlatMap(_triples)
         | "WriteRecords" >> beam.ParDo(_WriteFiles(str(records_dir), lambda t, w: f"{t[0]} {t[1]} {t[2].decode()}")))
    _ = batches | "WriteBatches" >> beam.ParDo(_WriteFiles(  # diagnostics for the assertion messages
        str(batches_dir), lambda rr, w: f"{time.time():.3f} p{rr.partition} @{rr.offsets[0]} n={len(rr)} "
                                        f"ts={min(rr.timestamps_ms)}..{max(rr.timestamps_ms)}"))
    _ = (batches | beam.WindowInto(FixedWindows(1))
         | beam.Map(lambda rr: ("n", len(rr))) | beam.CombinePerKey(sum)
         | "WriteWindows" >> beam.ParDo(_WriteFiles(str(windows_dir), lambda kv, w: f"{w.start} {kv[1]}")))
    t0 = time.monotonic()
    result = p.run()
    try:
        # Phase 1's one-second windows can only fire once the watermark passes their end: through
        # the records' timestamps, then the idle partitions' clock. Only then is phase 2 produced.
        deadline = time.monotonic() + 90
        while (_window_total(windows_dir) == 0 or len(_lines(records_dir)) < 2 * n1) and time.monotonic() < deadline:
            time.sleep(0.2)
        fired_at = time.monotonic() - t0
        assert _window_total(windows_dir) > 0, "no event-time window fired while the job ran"
        assert len(_lines(records_dir)) == 2 * n1
        acked += _produce(conn, topic, phase2)
        result.wait_until_finish(duration=90_000)
    finally:
        if not str(result.state).endswith("DONE"):
            result.cancel()
    assert str(result.state).endswith("DONE"), result.state
    got = sorted(tuple(line.split(" ", 2)) for line in _lines(records_dir))
    assert got == sorted((str(p_), str(o), v.decode()) for p_, o, v in acked)
    # Not asserted equal: in ~1 of 6 runs Prism let the watermark pass one partition's first batch
    # (read ~1 s after the other's) and the window dropped it as late; see docs/runners.md.
    assert 0 < _window_total(windows_dir) <= 2 * (n1 + n2)
    print(f"stream: phase 1 windows fired after {fired_at:.1f}s, job done after {time.monotonic() - t0:.1f}s")


def test_stream_tracker_grants_checkpoints_only():
    """Splitting ``[pos, sys.maxsize)`` at a fraction would give a reader offsets no log reaches (Prism asks)."""
    import sys

    from apache_beam.io.restriction_trackers import OffsetRange as BeamRange

    from pipelines.sources_kafka import _OffsetRangeProvider

    tracker = _OffsetRangeProvider(unbounded=True).create_tracker(BeamRange(10, sys.maxsize))
    assert tracker.try_claim(10)
    assert tracker.try_split(0.5) is None
    primary, residual = tracker.try_split(0)
    assert (primary.start, primary.stop, residual.start, residual.stop) == (10, 11, 11, sys.maxsize)
    bounded = _OffsetRangeProvider(unbounded=False).create_tracker(BeamRange(0, 100))
    assert bounded.try_split(0.5) is not None  # bounded ranges still split for parallelism


def test_stream_batch_time_of_a_fast_producer_is_clamped():
    """A record stamped hours ahead of the wall clock stamps its batch at wall clock + max_future_s only: one
    producer's fast clock cannot pull every event-time timer of the job forward."""
    from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
    from apache_beam.utils.timestamp import Timestamp

    from pipelines.sources_kafka import _StreamWatermarks

    now_ms = int(time.time() * 1000)
    batch = RawRecords(topic="t", partition=0, offsets=[0, 1], keys=[b"a", b"b"], values=[b"x", b"y"],
                       timestamps_ms=[now_ms - 1000, now_ms + 6 * 3600 * 1000])
    estimator = ManualWatermarkEstimator(None)
    clamped = _StreamWatermarks(idle_watermark_lag_s=1, max_future_s=300).batch_timestamp(estimator, batch)
    assert Timestamp.of(now_ms / 1000 + 299) < clamped <= Timestamp.now() + 300
    as_is = _StreamWatermarks(idle_watermark_lag_s=1).batch_timestamp(estimator, batch)
    assert as_is == Timestamp(micros=(now_ms + 6 * 3600 * 1000) * 1000)


def _whole_read(conn: KafkaConnection, topic: str, slices) -> tuple[list, list[PartitionReader]]:
    """Read ``slices`` through one _ReadWholeRangeFn (as a forked worker does); return triples and the readers used."""
    fn = _ReadWholeRangeFn(conn, stall_timeout_s=2, batch_size=50, max_wait_ms=100, max_partition_fetch_bytes=1 << 20)
    triples, readers = [], []
    for s in slices:
        triples += [t for batch in fn.process((topic, *s, 0)) for t in _triples(batch)]
        readers.append(_kept_reader(conn, fn._reader_kw)[0])
    return triples, readers


def _whole_read_triples(conn: KafkaConnection, topic: str, slices) -> list:
    return _whole_read(conn, topic, slices)[0]


@pytest.mark.integration
def test_whole_range_reads_keep_one_reader_per_process(filled_topic):
    conn, topic, acked = filled_topic
    ends = end_offsets(conn, topic)
    triples, readers = _whole_read(conn, topic, [(0, 0, ends[0]), (1, 2, ends[1]), (2, 0, ends[2])])
    assert sorted(triples) == [a for a in acked if a[0] != 1 or a[1] >= 2]
    assert readers[0] is readers[1] is readers[2]  # one reader for the process's three ranges

    # A read that fails (past the log's end) closes the kept reader; the next read makes a new one.
    fn = _ReadWholeRangeFn(conn, stall_timeout_s=1, batch_size=50, max_wait_ms=100, max_partition_fetch_bytes=1 << 20)
    with pytest.raises(ReadStalledError):
        list(fn.process((topic, 1, ends[1] - 1, ends[1] + 3, 0)))
    again, after = _whole_read(conn, topic, [(1, 0, ends[1])])
    assert sorted(again) == [a for a in acked if a[0] == 1]
    assert after[0] is not readers[0]

    # A forked child never uses the parent's reader (it makes its own), and the parent's still reads.
    with ProcessPoolExecutor(1, mp_context=get_context("fork")) as pool:
        child = pool.submit(_whole_read_triples, conn, topic, [(2, 0, ends[2])]).result(timeout=120)
    assert sorted(child) == [a for a in acked if a[0] == 2]
    mine, mine_readers = _whole_read(conn, topic, [(2, 0, ends[2])])
    assert sorted(mine) == sorted(child) and mine_readers[0] is after[0]
