"""Helpers shared by the test suite (import as ``support.pg`` / ``support.kafka``).

``tests/conftest.py`` puts ``tests/`` on ``sys.path`` (pytest's default
rootdir-relative import for a directory without ``__init__.py``), so test
modules import these as ``from support.pg import read_pgoutput``.
"""
