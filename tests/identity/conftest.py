"""The version matrix's fixtures (tests/versions/conftest.py), for tests here that
pick PostgreSQL majors with ``pytest.mark.parametrize("version_pg", [...], indirect=True)``."""

from versions.conftest import vdb, version_pg

__all__ = ["vdb", "version_pg"]
