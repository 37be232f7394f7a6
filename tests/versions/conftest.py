"""The version matrix: one PostgreSQL cluster per major (12 to 18) per module.

``version_pg`` is parametrized over :data:`MATRIX` (module scope, so pytest
runs every test of a module against one version before starting the next
cluster); it yields a :class:`VersionCluster` with the protocol version that
major speaks at most. A version that is not installed skips with the way to
install it -- except in CI (``CI`` set), where a missing version is a failure:
the matrix must not shrink unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.cdc import write_config
from support.pg import PgDatabase, require_version

from cdcd.tools.local import LocalBroker, LocalPostgres

#: PostgreSQL major -> the highest pgoutput protocol version it speaks.
MATRIX: dict[int, int] = {12: 1, 13: 1, 14: 2, 15: 3, 16: 4, 17: 4, 18: 4}


@dataclass
class VersionCluster:
    """A running cluster of one major and what the tests need to know of it."""

    version: int
    protocol: int
    cluster: LocalPostgres

    @property
    def streams_large(self) -> bool:
        """Whether large transactions are streamed before commit (protocol v2+)."""
        return self.protocol >= 2


def _settings(version: int) -> dict[str, str]:
    # 64kB makes a few thousand rows a streamed transaction on v2+; 12 lacks
    # the setting (it decodes with a fixed 4096-change limit instead).
    return {"logical_decoding_work_mem": "64kB"} if version >= 13 else {}


@pytest.fixture(scope="module", params=sorted(MATRIX), ids=lambda v: f"pg{v}")
def version_pg(request: pytest.FixtureRequest) -> Iterator[VersionCluster]:
    version: int = request.param
    require_version(version)
    cluster = LocalPostgres.start(settings=_settings(version), version=version)
    try:
        assert cluster.version == version
        yield VersionCluster(version, MATRIX[version], cluster)
    finally:
        cluster.cleanup()


@pytest.fixture
def vdb(version_pg: VersionCluster, request: pytest.FixtureRequest) -> Iterator[PgDatabase]:
    """A fresh database on this version's cluster, dropped (with its slots) afterwards."""
    # The version first: the name is also the topic prefix on the shared broker.
    prefix = f"v{version_pg.version}"
    with PgDatabase.fresh(version_pg.cluster, prefix, request.node.originalname) as db:
        yield db


@pytest.fixture
def vconfig(
    vdb: PgDatabase, version_pg: VersionCluster, broker: LocalBroker, tmp_path: Path
) -> Callable[..., Path]:
    """``vconfig(**overrides)``: a daemon config for ``vdb`` at the version's highest protocol."""

    def make(**overrides: Any) -> Path:
        overrides.setdefault("prefix", vdb.dbname)
        overrides.setdefault("slot", "cdcd_" + vdb.dbname[:50])
        postgres = {"protocol_version": version_pg.protocol, **overrides.pop("postgres", {})}
        return write_config(
            tmp_path / "cdcd.yaml", vdb.dsn, broker.bootstrap_servers, postgres=postgres, **overrides
        )

    return make
