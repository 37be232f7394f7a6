"""The daemon's /metrics, /healthz and /readyz while it really runs.

``test_metrics_http.py`` checks the registry and the HTTP server in isolation;
this module checks that the *daemon* feeds them: one ``cdcd run`` child
process (metrics on a known free port) streams a known workload, and what its
endpoints serve is scraped before, during and after. Dashboards and alerts
(docs/operations.md) trust these numbers, so the counts are exact and the
gauges must come back to rest after catch-up.

Sequence (one daemon for the module, tests in file order):

1. the broker starts frozen, so the daemon is up but cannot stream:
   ``/healthz`` 200, ``/readyz`` 503, ``cdcd_streaming`` 0;
2. the broker is thawed: ``/readyz`` 200, ``cdcd_streaming`` 1;
3. a known workload of 17 transactions on two tables;
4. a broker outage (frozen again) while rows are written, then recovery;
5. SIGTERM with a message in flight: not ready while draining, exit 0.

A separate test restarts a daemon on a 1M-row backlog to check that the slot
lag is sampled while catching up, when operators look at it most.

Each test states the documented behaviour of a metric (three of them caught
real bugs: stale in-flight gauges after catch-up, a confirmation age reset by
every status update, and lag not sampled during catch-up).
"""

from __future__ import annotations

import itertools
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cdc import DaemonProcess, wait_for, write_config
from support.pg import current_wal_lsn

import cdcd
from cdcd.tools.local import LocalBroker, LocalPostgres, free_port

pytestmark = pytest.mark.integration

TABLES = ("public.customers", "public.orders")
OPS = ("c", "u", "d", "r", "t")

#: What the workload of ``_run_workload`` must produce, per (table, op).
EXPECTED_EVENTS = {
    ("public.customers", "c"): 5,
    ("public.customers", "u"): 2,
    ("public.customers", "d"): 1,
    ("public.orders", "c"): 31,  # 30 inserts + the new key of a primary key change
    ("public.orders", "u"): 7,
    ("public.orders", "d"): 5,  # 4 deletes + the old key of a primary key change
    ("public.orders", "t"): 1,
}
EXPECTED_TRANSACTIONS = 17

#: "Near zero" for the slot lag at rest: the daemon confirms the walsender's
#: position when idle, but the server may write a few records of its own
#: (checkpoints, running-xacts) between a confirmation and the next sample.
LAG_AT_REST_BYTES = 16 * 1024
#: The daemon samples the slot lag every 5 s by default (1 s in ``live``);
#: allow a few samples.
LAG_SAMPLE_WAIT_S = 20.0

_db_counter = itertools.count(1)



Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Scrape:
    """One scrape of /metrics, with lookups by name and labels."""

    samples: Samples

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def value(self, name: str, **labels: str) -> float:
        found = self.get(name, **labels)
        assert found is not None, f"{name}{labels or ''} is not exposed"
        return found

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def labelled(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}


def http_get(url: str) -> tuple[int, str]:
    """(status, body) without raising on 4xx/5xx."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


@dataclass
class LiveRun:
    """The module's daemon and what was observed along the way."""

    pg: LocalPostgres
    dbname: str
    broker: LocalBroker
    daemon: DaemonProcess | None
    base_url: str
    before_streaming: dict[str, Any] = field(default_factory=dict)
    streaming: dict[str, Any] = field(default_factory=dict)
    after_workload: dict[str, Any] = field(default_factory=dict)

    def scrape(self) -> Scrape:
        status, body = http_get(self.base_url + "/metrics")
        assert status == 200, body
        out: Samples = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return Scrape(out)

    def endpoint(self, path: str) -> tuple[int, str]:
        return http_get(self.base_url + path)

    def endpoint_ok(self, path: str) -> bool:
        """Whether ``path`` answers 200 (``False`` also while nothing listens yet)."""
        try:
            return self.endpoint(path)[0] == 200
        except OSError:
            return False

    def real_lag(self) -> int:
        """The server's view: current WAL position minus the slot's confirmed_flush_lsn."""
        rows = self.pg.execute(
            "SELECT pg_current_wal_lsn() - confirmed_flush_lsn FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (self.dbname,),
            dbname=self.dbname,
        )
        return int(rows[0][0])

    def sql(self, statement: str) -> None:
        self.pg.execute(statement, dbname=self.dbname)

    def wal_lsn(self) -> int:
        with self.pg.connection(self.dbname) as conn:
            return current_wal_lsn(conn)


def _run_workload(run: LiveRun) -> None:
    """17 transactions whose effect on every counter is known (EXPECTED_*)."""
    run.sql("INSERT INTO customers(name) SELECT 'customer ' || g FROM generate_series(1, 5) g")
    for batch in range(10):
        run.sql(
            "INSERT INTO orders(customer_id, status, amount) "
            f"SELECT {batch % 5 + 1}, 'new', g * 1.25 FROM generate_series(1, 3) g"
        )
    run.sql("UPDATE orders SET status = 'paid' WHERE id <= 7")
    run.sql("DELETE FROM orders WHERE id > 26")
    run.sql("UPDATE customers SET name = upper(name) WHERE id IN (1, 2)")
    # A primary key change: published as a delete of the old key and a create
    # of the new one, as Debezium does.
    run.sql("UPDATE orders SET id = 1000 WHERE id = 1")
    run.sql("DELETE FROM customers WHERE id = 5")
    run.sql("TRUNCATE orders")


@pytest.fixture(scope="module")
def live(pg_cluster: LocalPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """Start the daemon against a frozen broker, record, thaw, run the workload."""
    dbname = f"metrics_live_{next(_db_counter)}"
    pg_cluster.create_database(dbname)
    pg_cluster.execute(
        "CREATE TABLE customers(id serial PRIMARY KEY, name text NOT NULL);"
        "CREATE TABLE orders(id bigserial PRIMARY KEY, customer_id int NOT NULL, "
        "status text NOT NULL, amount numeric(12,2) NOT NULL)",
        dbname=dbname,
    )
    tmp = tmp_path_factory.mktemp("metrics_live")
    broker = LocalBroker.start()
    port = free_port()
    config = write_config(
        Path(tmp) / "cdcd.yaml",
        pg_cluster.dsn(dbname),
        broker.bootstrap_servers,
        prefix=dbname,
        slot=dbname,
        tables=list(TABLES),
        # No heartbeats: they would add to the transaction-independent
        # counters at unpredictable times.
        # Lag sampled every second, not the default 5 s: the waits for a
        # sample below end sooner; what a sample must show is the same.
        # No re-snapshots: the workload's TRUNCATE gives orders new files,
        # which cdcd heals (it cannot rule out a rewrite) when it compares
        # them with the catalog -- at the table's first use if the TRUNCATE
        # committed before it, else at the idle check. The heal's watermark
        # transactions would make the counts below depend on that timing.
        extra={"metrics": {"listen": f"127.0.0.1:{port}", "lag_sample_interval_s": 1.0},
               "heartbeat": {"interval_s": 0},
               "schema_changes": {"resnapshot": "never", "check_interval_s": 0}},
    )
    daemon: DaemonProcess | None = None
    try:
        broker.freeze()
        daemon = DaemonProcess(config, Path(tmp) / "daemon.log")
        run = LiveRun(pg_cluster, dbname, broker, daemon, f"http://127.0.0.1:{port}")

        def up() -> bool:
            assert daemon is not None and daemon.alive(), daemon.log() if daemon else ""
            try:
                return http_get(run.base_url + "/healthz")[0] == 200
            except OSError:
                return False

        wait_for(up, timeout_s=30, what="the metrics endpoint")
        # Give the session time to reach the broker check, which blocks on the
        # frozen broker: the daemon is alive, but not streaming.
        wait_for(
            lambda: pg_cluster.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (dbname,)
            ),
            timeout_s=30,
            what="the slot",
        )
        run.before_streaming = {
            "healthz": run.endpoint("/healthz"),
            "readyz": run.endpoint("/readyz"),
            "metrics": run.scrape(),
        }
        broker.thaw()
        wait_for(lambda: run.endpoint("/readyz")[0] == 200, timeout_s=60, what="/readyz 200")
        run.streaming = {
            "healthz": run.endpoint("/healthz"),
            "readyz": run.endpoint("/readyz"),
            "metrics": run.scrape(),
        }
        _run_workload(run)
        target = run.wal_lsn()
        wait_for(
            lambda: run.scrape().value("cdcd_confirmed_lsn_bytes") >= target,
            timeout_s=60,
            what="confirmation of the workload",
        )
        run.after_workload = {"target": target, "metrics": run.scrape()}
        yield run
    finally:
        if broker.frozen:
            broker.thaw()
        if daemon is not None:
            # The last test stops the daemon itself; otherwise stop it here.
            code = daemon.terminate() if daemon.alive() else daemon.proc.wait()
            assert code == 0, daemon.log()
        broker.cleanup()
        pg_cluster.drop_database(dbname)


# -- before streaming ---------------------------------------------------------------------


def test_not_ready_but_alive_before_streaming(live: LiveRun) -> None:
    status, body = live.before_streaming["readyz"]
    assert status == 503, body
    assert body.startswith("not ready")
    assert live.before_streaming["healthz"][0] == 200
    before: Scrape = live.before_streaming["metrics"]
    assert before.value("cdcd_streaming") == 0
    assert before.value("cdcd_transactions_total") == 0


def test_build_info_carries_the_versions(live: LiveRun) -> None:
    info = live.before_streaming["metrics"].labelled("cdcd_build_info")
    assert len(info) == 1
    ((labels, value),) = info.items()
    assert value == 1
    as_dict = dict(labels)
    assert as_dict["version"] == cdcd.__version__
    assert as_dict["python"].count(".") == 2
    assert as_dict["librdkafka"] not in ("", "unknown")


# -- streaming ------------------------------------------------------------------------------


def test_ready_and_alive_while_streaming(live: LiveRun) -> None:
    assert live.streaming["readyz"] == (200, "ok: streaming\n")
    assert live.streaming["healthz"][0] == 200
    assert live.streaming["metrics"].value("cdcd_streaming") == 1
    # Still so after the workload.
    assert live.endpoint("/readyz")[0] == 200
    assert live.endpoint("/healthz")[0] == 200


def test_events_are_counted_exactly_per_table_and_op(live: LiveRun) -> None:
    scrape: Scrape = live.after_workload["metrics"]
    counted = {
        (table, op): scrape.get("cdcd_events_total", table=table, op=op)
        for table in TABLES
        for op in OPS
    }
    expected = {
        (table, op): float(EXPECTED_EVENTS.get((table, op), 0)) for table in TABLES for op in OPS
    }
    assert counted == expected
    # Nothing before the workload.
    before: Scrape = live.streaming["metrics"]
    assert not any(before.labelled("cdcd_events_total").values())


def test_transactions_are_counted_once_each(live: LiveRun) -> None:
    scrape: Scrape = live.after_workload["metrics"]
    assert scrape.value("cdcd_transactions_total") == EXPECTED_TRANSACTIONS
    assert live.streaming["metrics"].value("cdcd_transactions_total") == 0


def test_delivery_latency_is_observed(live: LiveRun) -> None:
    scrape: Scrape = live.after_workload["metrics"]
    count = scrape.value("cdcd_delivery_latency_seconds_count")
    assert count > 0
    assert scrape.value("cdcd_delivery_latency_seconds_sum") >= 0
    # Cumulative buckets end at the count; a local pipeline is well under 10 s.
    assert scrape.value("cdcd_delivery_latency_seconds_bucket", le="+Inf") == count
    assert scrape.value("cdcd_delivery_latency_seconds_bucket", le="10.0") == count
    assert scrape.value("cdcd_delivery_errors_total", topic=f"{live.dbname}.public.orders") == 0


def test_received_and_confirmed_positions_advance(live: LiveRun) -> None:
    start: Scrape = live.streaming["metrics"]
    end: Scrape = live.after_workload["metrics"]
    target = live.after_workload["target"]
    assert end.value("cdcd_confirmed_lsn_bytes") >= target > start.value("cdcd_confirmed_lsn_bytes")
    assert end.value("cdcd_received_lsn_bytes") > start.value("cdcd_received_lsn_bytes")
    assert end.value("cdcd_received_bytes_total") > start.value("cdcd_received_bytes_total")
    # Confirmation is recent, and a scrape-time gauge.
    assert end.value("cdcd_last_confirmed_age_seconds") < 15


def test_slot_lag_returns_near_zero_after_catch_up(live: LiveRun) -> None:
    wait_for(
        lambda: live.scrape().value("cdcd_slot_lag_bytes") <= LAG_AT_REST_BYTES,
        timeout_s=LAG_SAMPLE_WAIT_S,
        what=f"cdcd_slot_lag_bytes <= {LAG_AT_REST_BYTES}",
    )


def test_in_flight_and_queue_return_to_zero_after_catch_up(live: LiveRun) -> None:
    # Everything was acknowledged (the confirmed LSN passed the workload), so
    # nothing can still be in flight or queued in librdkafka.
    scrape = live.scrape()
    assert scrape.value("cdcd_messages_in_flight") == 0
    assert scrape.value("cdcd_producer_queue_messages") == 0


# -- broker outage ----------------------------------------------------------------------

#: Rows written during the outage, in this many transactions.
OUTAGE_ROWS, OUTAGE_TRANSACTIONS = 200, 5
#: How long the broker stays frozen at least (several status intervals of 1 s).
OUTAGE_MIN_S = 4.0


@dataclass
class Outage:
    """What the metrics said during and after a broker outage with writes pending."""

    confirmed_before: float
    target: int
    stuck_for_s: float
    during: Scrape
    after: Scrape


@pytest.fixture(scope="module")
def outage(live: LiveRun) -> Outage:
    """Freeze the broker, write, watch, thaw, wait for recovery (runs once, after the above)."""
    confirmed_before = live.scrape().value("cdcd_confirmed_lsn_bytes")
    live.broker.freeze()
    try:
        for _ in range(OUTAGE_TRANSACTIONS):
            live.sql(
                "INSERT INTO customers(name) SELECT 'outage ' || g "
                f"FROM generate_series(1, {OUTAGE_ROWS // OUTAGE_TRANSACTIONS}) g"
            )
        stuck_since = time.monotonic()
        target = live.wal_lsn()
        written = target - confirmed_before
        # Nothing can be acknowledged, so the sampled lag must come to cover
        # at least the WAL written since the last confirmation.
        wait_for(
            lambda: live.scrape().value("cdcd_slot_lag_bytes") >= written,
            timeout_s=LAG_SAMPLE_WAIT_S,
            what="cdcd_slot_lag_bytes to cover the unacknowledged WAL",
        )
        time.sleep(max(0.0, stuck_since + OUTAGE_MIN_S - time.monotonic()))
        during = live.scrape()
        stuck_for = time.monotonic() - stuck_since
        assert live.endpoint("/healthz")[0] == 200
    finally:
        live.broker.thaw()
    wait_for(
        lambda: live.scrape().value("cdcd_confirmed_lsn_bytes") >= target,
        timeout_s=60,
        what="confirmation after the outage",
    )
    wait_for(
        lambda: live.scrape().value("cdcd_slot_lag_bytes") <= LAG_AT_REST_BYTES,
        timeout_s=LAG_SAMPLE_WAIT_S,
        what="cdcd_slot_lag_bytes back near zero",
    )
    return Outage(confirmed_before, target, stuck_for, during, live.scrape())


def test_outage_stops_confirmation_and_lag_grows(outage: Outage) -> None:
    during = outage.during
    assert during.value("cdcd_confirmed_lsn_bytes") < outage.target
    assert during.value("cdcd_slot_lag_bytes") >= outage.target - outage.confirmed_before
    assert during.value("cdcd_messages_in_flight") > 0
    # Counted at commit, before Kafka acknowledged anything.
    customers_c = EXPECTED_EVENTS["public.customers", "c"] + OUTAGE_ROWS
    assert during.value("cdcd_events_total", table="public.customers", op="c") == customers_c
    assert during.value("cdcd_streaming") == 1


def test_outage_recovers_lag_and_counts(outage: Outage, live: LiveRun) -> None:
    after = outage.after
    assert after.value("cdcd_confirmed_lsn_bytes") >= outage.target
    assert after.value("cdcd_slot_lag_bytes") <= LAG_AT_REST_BYTES
    assert after.value("cdcd_transactions_total") == EXPECTED_TRANSACTIONS + OUTAGE_TRANSACTIONS
    assert after.value("cdcd_delivery_errors_total", topic=f"{live.dbname}.public.customers") == 0
    assert live.endpoint("/readyz")[0] == 200


def test_last_confirmed_age_grows_while_confirmation_is_stuck(outage: Outage) -> None:
    # docs/operations.md: "Computed at scrape time, so it grows while
    # confirmation is stuck" -- the CdcdConfirmationStalled alert relies on it.
    age = outage.during.value("cdcd_last_confirmed_age_seconds")
    assert age >= outage.stuck_for_s - 1.5, (
        f"confirmation was stuck for {outage.stuck_for_s:.1f} s but the age says {age:.1f} s"
    )


def test_in_flight_and_queue_return_to_zero_after_the_outage(outage: Outage) -> None:
    assert outage.after.value("cdcd_messages_in_flight") == 0
    assert outage.after.value("cdcd_producer_queue_messages") == 0


# -- stopping -----------------------------------------------------------------------------


def test_not_ready_while_draining_after_sigterm(live: LiveRun, outage: Outage) -> None:
    """SIGTERM with messages in flight: /readyz turns 503 at once, the drain waits for Kafka."""
    daemon = live.daemon
    assert daemon is not None
    live.broker.freeze()
    try:
        live.sql("INSERT INTO customers(name) VALUES ('last one')")
        target = live.wal_lsn()
        wait_for(
            lambda: (
                live.scrape().value("cdcd_events_total", table="public.customers", op="c")
                == EXPECTED_EVENTS["public.customers", "c"] + OUTAGE_ROWS + 1
            ),
            timeout_s=30,
            what="the last insert to be produced",
        )
        daemon.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: live.endpoint("/readyz")[0] == 503, timeout_s=10, what="/readyz 503 on stop"
        )
        status, body = live.endpoint("/readyz")
        assert body.startswith("not ready"), body
        draining = live.scrape()
        assert draining.value("cdcd_streaming") == 0
        assert draining.value("cdcd_confirmed_lsn_bytes") < target
        assert live.endpoint("/healthz")[0] == 200
        assert daemon.alive(), "the daemon waits for the in-flight message"
    finally:
        live.broker.thaw()
    assert daemon.wait(60) == 0, daemon.log()
    confirmed = live.pg.execute(
        "SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name = %s",
        (live.dbname,),
    )[0][0]
    assert confirmed >= target, "drained and confirmed before exiting"
    with pytest.raises(OSError):
        live.endpoint("/metrics")


# -- catching up a backlog ---------------------------------------------------------------

#: A backlog that takes this machine (2 cores) seconds to catch up (400k rows
#: of ~60 bytes, about 66 MB of WAL: 3-4 s at 100-130k rows/s)...
BACKLOG_ROWS = 400_000
#: ...which is a dozen or more lag-sampling periods at this interval.
LAG_SAMPLE_S = 0.2


def test_slot_lag_is_sampled_while_catching_up_a_backlog(
    pg_cluster: LocalPostgres, broker: LocalBroker, tmp_path: Path
) -> None:
    dbname = f"metrics_backlog_{next(_db_counter)}"
    pg_cluster.create_database(dbname)
    daemon: DaemonProcess | None = None
    try:
        pg_cluster.execute("CREATE TABLE t(id bigserial PRIMARY KEY, v text)", dbname=dbname)
        port = free_port()
        config = write_config(
            tmp_path / "cdcd.yaml",
            pg_cluster.dsn(dbname),
            broker.bootstrap_servers,
            prefix=dbname,
            slot=dbname,
            tables=["public.t"],
            extra={
                "metrics": {"listen": f"127.0.0.1:{port}", "lag_sample_interval_s": LAG_SAMPLE_S},
                "heartbeat": {"interval_s": 0},
            },
        )
        run = LiveRun(pg_cluster, dbname, broker, None, f"http://127.0.0.1:{port}")
        daemon = DaemonProcess(config, tmp_path / "first.log")
        wait_for(lambda: run.endpoint_ok("/readyz"), timeout_s=60, what="first daemon streaming")
        assert daemon.terminate() == 0, daemon.log()

        for _ in range(BACKLOG_ROWS // 50_000):
            run.sql("INSERT INTO t(v) SELECT md5(g::text) FROM generate_series(1, 50000) g")
        backlog = run.real_lag()

        daemon = DaemonProcess(config, tmp_path / "second.log")
        wait_for(lambda: run.endpoint_ok("/readyz"), timeout_s=60, what="second daemon streaming")
        started = time.monotonic()
        gauges: list[float] = []
        while (real := run.real_lag()) > LAG_AT_REST_BYTES:
            assert time.monotonic() - started < 300, "backlog not caught up within 300 s"
            gauges.append(run.scrape().value("cdcd_slot_lag_bytes"))
            time.sleep(0.25)
        catch_up_s = time.monotonic() - started
        assert catch_up_s > 4 * LAG_SAMPLE_S, (
            f"backlog caught up in {catch_up_s:.1f} s: too fast to observe sampling; "
            "raise BACKLOG_ROWS"
        )
        # Sampled every LAG_SAMPLE_S, the gauge must have followed the
        # progress at least once while the backlog shrank.
        assert any(g < 0.75 * backlog for g in gauges), (
            f"cdcd_slot_lag_bytes stayed at {sorted(set(gauges))} during a {catch_up_s:.0f} s "
            f"catch-up of {backlog} bytes (last real lag {real})"
        )
        assert daemon.terminate() == 0, daemon.log()
        print(f"backlog {backlog} bytes caught up in {catch_up_s:.1f} s, {len(gauges)} scrapes")
    finally:
        if daemon is not None and daemon.alive():
            daemon.kill9()
        pg_cluster.drop_database(dbname)
