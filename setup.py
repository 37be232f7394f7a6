"""The optional C extensions of cdcd's hot path (everything else is in pyproject.toml).

Each is one C file of this package, compiled with the Python headers (and, for
the Kafka producer, librdkafka's header: it runs the library confluent-kafka
loaded). They are ``optional``: without a compiler (or headers) the build
skips them with a warning and cdcd runs its pure-Python reference code
(``cdcd.protocol.native``), and confluent-kafka's producer.
Each module records the SHA-256 of the source it was built from, so that an
editable install whose C source changed since is detected and not used.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def _extension(module: str, **extra: list[str]) -> Extension:
    source = Path(*module.split(".")).with_suffix(".c")
    digest = hashlib.sha256((ROOT / source).read_bytes()).hexdigest()
    return Extension(
        module,
        [str(source)],
        define_macros=[("CDCD_NATIVE_SOURCE", f'"{digest}"')],
        extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
        optional=True,
        **extra,  # type: ignore[arg-type]
    )


setup(
    ext_modules=[
        _extension("cdcd.protocol._native"),
        _extension("cdcd.envelope._native"),
        # Also needs rdkafka.h (Debian: librdkafka-dev) for librdkafka's types;
        # the library itself is the one confluent-kafka loaded, opened at run time.
        _extension("cdcd.sink._rdkafka", libraries=["dl"]),
        # libpq calls on psycopg2's connection (the replication stream, COPY),
        # into the libpq psycopg2 loaded, opened at run time.
        _extension("cdcd.source._libpq", libraries=["dl"]),
    ]
)
