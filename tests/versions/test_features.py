"""Feature detection by server version, without a server (``cdcd.source.versions``, markers).

What cdcd asks of a server must follow from its version alone: the pgoutput
options it sends, the protocol versions it accepts (refused in one line
naming both versions), and where messages are missing (12, 13) the
transactions that stand for heartbeats and watermarks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.fault_sink import FaultSink

from cdcd.ack.tracker import AckTracker
from cdcd.envelope.encoder import EnvelopeEncoder
from cdcd.envelope.wire import SingleObjectFormat
from cdcd.errors import DefiniteError
from cdcd.naming import HEARTBEAT_PREFIX, WATERMARK_PREFIX
from cdcd.observability.metrics import Metrics
from cdcd.pipeline.publisher import Publisher
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import LogicalMessage
from cdcd.source.markers import MarkerTransactions
from cdcd.source.replication import ReplicationStream
from cdcd.source.versions import (
    has_decoding_work_mem,
    has_messages,
    has_two_phase_slots,
    has_wal_status,
    max_protocol,
    require_protocol,
    version_text,
)
from cdcd.tools.local.postgres import PostgresSetupError, find_bindir, installed_versions

#: A server_version_num of each supported major (the matrix's patch levels).
SERVERS = {12: 120022, 13: 130023, 14: 140023, 15: 150018, 16: 160014, 17: 170010, 18: 180004}
HIGHEST = {12: 1, 13: 1, 14: 2, 15: 3, 16: 4, 17: 4, 18: 4}


@pytest.mark.parametrize("major", sorted(SERVERS))
def test_features_follow_the_version(major: int) -> None:
    version = SERVERS[major]
    assert max_protocol(version) == HIGHEST[major]
    assert has_messages(version) is (major >= 14)
    assert has_wal_status(version) is (major >= 13)
    assert has_decoding_work_mem(version) is (major >= 13)
    assert has_two_phase_slots(version) is (major >= 14)
    assert version_text(version) == f"{major}.{version % 10000}"


@pytest.mark.parametrize("major", sorted(SERVERS))
def test_replication_options_ask_only_for_what_the_server_has(major: int) -> None:
    for protocol in range(1, HIGHEST[major] + 1):
        stream = ReplicationStream.__new__(ReplicationStream)  # options() needs no connection
        stream.protocol_version = protocol
        stream.publication = "cdcd"
        stream.server_version = SERVERS[major]
        options = stream.options()
        assert ("messages" in options) is (major >= 14), (major, protocol, options)
        assert ("streaming" in options) is (protocol >= 2)
        assert ("two_phase" in options) is (protocol >= 3)
        assert options.get("streaming") == {2: "on", 3: "on", 4: "parallel"}.get(protocol)


@pytest.mark.parametrize("major", sorted(SERVERS))
def test_a_protocol_above_the_servers_is_one_definite_line(major: int) -> None:
    version = SERVERS[major]
    for protocol in range(1, HIGHEST[major] + 1):
        require_protocol(version, protocol)
    for protocol in range(HIGHEST[major] + 1, 5):
        with pytest.raises(DefiniteError) as caught:
            require_protocol(version, protocol)
        line = str(caught.value)
        assert "\n" not in line
        since = {2: 14, 3: 15, 4: 16}[protocol]
        assert line.startswith(
            f"postgres.protocol_version {protocol} needs PostgreSQL {since} or newer, but the "
            f"server is PostgreSQL {version_text(version)}, which speaks pgoutput protocol "
            f"{HIGHEST[major]} at most"
        ), line
        assert line.endswith(f"; set postgres.protocol_version to {HIGHEST[major]}"), line
        assert caught.value.exit_code == 3


def test_markers_are_taken_once_by_their_32_bit_xid() -> None:
    markers = MarkerTransactions()
    epoch_xid = (3 << 32) | 4242  # txid_current() carries the epoch; pgoutput does not
    markers.expect(epoch_xid, WATERMARK_PREFIX, b"low run:1")
    assert markers.take(4243, Lsn(1)) is None
    taken = markers.take(4242, Lsn(0x1234))
    assert taken == LogicalMessage(None, 1, Lsn(0x1234), WATERMARK_PREFIX, b"low run:1")
    assert taken.transactional
    assert markers.take(4242, Lsn(0x1234)) is None
    assert len(markers) == 0


def _publisher(metrics: Metrics) -> Publisher:
    sink = FaultSink()
    wire = SingleObjectFormat(lambda key, value: None)
    return Publisher(
        sink,
        AckTracker(Lsn(0), classify=sink.delivery_failure),
        EnvelopeEncoder("pg", "app", wire),
        wire,
        include=lambda schema, table: True,
        ensure_topic=lambda topic: None,
        metrics=metrics,
    )


def test_publisher_handles_a_marker_transaction_as_its_message() -> None:
    metrics = Metrics(process_collectors=False)
    publisher = _publisher(metrics)
    markers = MarkerTransactions()
    publisher.use_markers(markers)
    seen: list[LogicalMessage] = []
    publisher.on_watermark(seen.append)
    markers.expect(10, WATERMARK_PREFIX, b"high run:7")
    markers.expect(11, HEARTBEAT_PREFIX, b"")

    publisher.begin_transaction(9, Lsn(0x90), 0)  # any other transaction: nothing
    publisher.commit_transaction(Lsn(0x98))
    publisher.begin_transaction(10, Lsn(0xA0), 0)
    assert [(m.prefix, m.content, m.lsn) for m in seen] == [(WATERMARK_PREFIX, b"high run:7", Lsn(0xA0))]
    publisher.commit_transaction(Lsn(0xA8))
    publisher.begin_transaction(11, Lsn(0xB0), 0)
    publisher.commit_transaction(Lsn(0xB8))
    assert metrics.registry.get_sample_value("cdcd_heartbeats_total") == 1
    assert len(seen) == 1


def test_an_uninstalled_version_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CDCD_PG_VERSIONS_DIR", str(tmp_path))
    (tmp_path / "11" / "bin").mkdir(parents=True)  # no server binaries in it: not installed
    assert 11 not in installed_versions()
    with pytest.raises(PostgresSetupError, match=r"PostgreSQL 11 is not installed .*`bash \.ci/setup`"):
        find_bindir(11)
