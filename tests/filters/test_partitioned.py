"""Partitioned tables: rows moving between partitions, via the root or per leaf.

``measures`` is partitioned by range on ``k`` (three leaves). An UPDATE of
``k`` moves a row to another partition, which PostgreSQL executes (and
decodes) as a DELETE from the old leaf and an INSERT into the new one.

- ``publish_via_partition_root: true``: everything, the initial snapshot
  included, is published as the root ``public.measures``: one topic, and its
  replay equals ``SELECT * FROM measures``; no leaf topic exists.
- ``false``: each leaf is published as itself: one topic per leaf, the
  snapshot read per leaf (also when ``cdcd snapshot --table`` names the
  root), and the union of the leaf topics' replays equals
  the table (each leaf's replay equals that leaf).
"""

from __future__ import annotations

import pytest
from support.cdc import table_topics

from .helpers import (
    OWNERSHIP,
    assert_same,
    expected_rows,
    job_status,
    postgres_section,
    read_topics,
    replayed,
    request_snapshot,
    stream_workload,
    table_entry,
    wait_caught_up,
    wait_for,
)

pytestmark = pytest.mark.integration

LEAVES = ["measures_low", "measures_mid", "measures_high"]
CREATE = """
CREATE TABLE measures(id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY RANGE (k);
CREATE TABLE measures_low PARTITION OF measures FOR VALUES FROM (0) TO (100);
CREATE TABLE measures_mid PARTITION OF measures FOR VALUES FROM (100) TO (200);
CREATE TABLE measures_high PARTITION OF measures FOR VALUES FROM (200) TO (300);
INSERT INTO measures SELECT g, (g * 7) % 300, 'v' || g FROM generate_series(1, 60) g;
"""
WORKLOAD = [
    "INSERT INTO measures SELECT g, (g * 11) % 300, 'new' FROM generate_series(61, 90) g",
    # moves between partitions (the partition key is part of the key)
    "UPDATE measures SET k = k + 100 WHERE k < 200 AND id % 4 = 0",
    "UPDATE measures SET k = k - 200, v = 'wrapped' WHERE k >= 200 AND id % 5 = 0",
    # updates inside a partition, and deletes
    "UPDATE measures SET v = 'same leaf' WHERE id % 7 = 0",
    "DELETE FROM measures WHERE id % 9 = 0",
]
KEY = ("id", "k")


def run(pg, broker, cdc_config, daemons, owned: bool, via_root: bool, resnapshot: bool = False):
    pg.execute(CREATE)
    config = cdc_config(
        postgres=postgres_section(pg, owned, [table_entry("public.measures")], via_root=via_root),
        extra={"snapshot": {"mode": "initial", "chunk_rows": 20}},
    )
    daemon = stream_workload(pg, daemons, config, WORKLOAD)
    if resnapshot:
        job = request_snapshot(config, "public.measures")  # the root
        wait_for(lambda: job_status(pg, job) == "done", timeout_s=60, interval_s=0.1,
                 what="the incremental snapshot of the leaves")
    wait_caught_up(pg, daemon)
    return config


@pytest.mark.parametrize("owned", OWNERSHIP)
def test_via_root_one_topic_equals_the_table(pg, broker, cdc_config, daemons, owned: bool) -> None:
    run(pg, broker, cdc_config, daemons, owned, via_root=True)
    prefix = pg.dbname
    assert table_topics(broker.bootstrap_servers, prefix) == [f"{prefix}.public.measures"]
    read = read_topics(broker, prefix, [f"{prefix}.public.measures"])
    moved = [c for c in read.changes if c.value and c.value["op"] == "d"]
    assert moved, "the workload moved rows between partitions"
    assert {c.value["source"]["table"] for c in read.changes if c.value} == {"measures"}
    assert_same(replayed(read.changes, KEY), expected_rows(pg, "SELECT * FROM measures", KEY))


@pytest.mark.parametrize("owned", OWNERSHIP)
def test_per_leaf_topics_union_equals_the_table(pg, broker, cdc_config, daemons, owned: bool) -> None:
    run(pg, broker, cdc_config, daemons, owned, via_root=False, resnapshot=True)
    prefix = pg.dbname
    topics = [f"{prefix}.public.{leaf}" for leaf in LEAVES]
    assert table_topics(broker.bootstrap_servers, prefix) == sorted(topics)
    read = read_topics(broker, prefix, topics)
    union: dict = {}
    for leaf, topic in zip(LEAVES, topics, strict=True):
        changes = [c for c in read.changes if c.topic == topic]
        # The initial and the incremental snapshot (`cdcd snapshot --table` the
        # root) read each leaf itself.
        snapshots = {c.lsn for c in changes if c.value and c.value["op"] == "r"}
        assert len(snapshots) >= 2, (leaf, snapshots)
        got = replayed(changes, KEY)
        assert_same(got, expected_rows(pg, f"SELECT * FROM {leaf}", KEY))
        union.update(got)
    assert_same(union, expected_rows(pg, "SELECT * FROM measures", KEY))
