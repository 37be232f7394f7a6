"""Which PostgreSQL server binaries the throwaway clusters run, and as which user.

Found by major version (``.ci/setup`` installs 12 to 18 beside Debian's 15),
through ``$CDCD_PG_BINDIR``, or ``pg_config``. PostgreSQL refuses to run as
root: then every server command runs as the ``postgres`` system user.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path

#: Where the Debian ``postgresql-15`` package puts the server binaries.
DEBIAN_BINDIR = Path("/usr/lib/postgresql/15/bin")

#: Environment variable that names a directory holding ``initdb`` and ``pg_ctl``.
BINDIR_ENV = "CDCD_PG_BINDIR"

#: Environment variable naming where ``.ci/setup`` installs the other server
#: versions (``<dir>/<major>/bin``); the defaults below are setup's too.
VERSIONS_DIR_ENV = "CDCD_PG_VERSIONS_DIR"
_ROOT_VERSIONS_DIR = Path("/var/cache/cdcd/postgres")

_INSTALL_HINT = "install PostgreSQL 15 with `apt-get install -y postgresql-15`"


class PostgresSetupError(RuntimeError):
    """The throwaway cluster could not be created, started or stopped.

    The message says which command failed and includes its output (or the tail
    of the server log), because the usual causes -- a missing package, a port
    race, a directory the ``postgres`` user cannot reach -- are only visible
    there.
    """


def has_server_binaries(bindir: Path) -> bool:
    """Whether ``bindir`` holds executable ``initdb`` and ``pg_ctl``."""
    return all(os.access(bindir / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres"))


def versions_dir() -> Path:
    """Where ``.ci/setup`` installs PostgreSQL 12, 13, 14, 16, 17 and 18.

    ``$CDCD_PG_VERSIONS_DIR``; else ``/var/cache/cdcd/postgres`` as root (the
    ``postgres`` user must reach it, which rules out root's home) and
    ``~/.cache/cdcd/postgres`` otherwise.
    """
    override = os.environ.get(VERSIONS_DIR_ENV)
    if override:
        return Path(override)
    if os.geteuid() == 0:
        return _ROOT_VERSIONS_DIR
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "cdcd" / "postgres"


def installed_versions() -> dict[int, Path]:
    """Major version -> bin directory of every PostgreSQL server found here, sorted.

    Looks in :func:`versions_dir` (``<major>/bin``) and in Debian's
    ``/usr/lib/postgresql/<major>/bin``; Debian's wins for a major both have.
    """
    found: dict[int, Path] = {}
    for root in (versions_dir(), DEBIAN_BINDIR.parent.parent):
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.name.isdigit() and has_server_binaries(entry / "bin"):
                found[int(entry.name)] = entry / "bin"
    return dict(sorted(found.items()))


def find_bindir(version: int | None = None) -> Path:
    """Locate the PostgreSQL server binaries (``initdb``, ``pg_ctl``, ``postgres``).

    With ``version`` (a major, e.g. ``12``): that version's directory from
    :func:`installed_versions`, or an error saying how to install it.
    Otherwise, in order: ``$CDCD_PG_BINDIR`` (an explicit choice, never
    silently ignored), the Debian PostgreSQL 15 directory, then ``pg_config
    --bindir``. Debian puts the server binaries outside ``PATH``, which is why
    ``PATH`` alone is not consulted.
    """
    if version is not None:
        installed = installed_versions()
        if version not in installed:
            have = ", ".join(str(v) for v in installed) or "none"
            raise PostgresSetupError(
                f"PostgreSQL {version} is not installed (found: {have}; looked in "
                f"{versions_dir()} and {DEBIAN_BINDIR.parent.parent}); `bash .ci/setup` "
                f"installs 12, 13, 14, 16, 17 and 18 there (${VERSIONS_DIR_ENV} moves it)"
            )
        return installed[version]
    override = os.environ.get(BINDIR_ENV)
    if override:
        path = Path(override)
        if not has_server_binaries(path):
            raise PostgresSetupError(
                f"{BINDIR_ENV}={override!r} does not contain executable initdb, pg_ctl "
                f"and postgres; point it at a PostgreSQL bin directory or {_INSTALL_HINT}"
            )
        return path
    if has_server_binaries(DEBIAN_BINDIR):
        return DEBIAN_BINDIR
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        result = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, check=False
        )
        if result.returncode == 0:
            path = Path(result.stdout.strip())
            if has_server_binaries(path):
                return path
    raise PostgresSetupError(
        f"PostgreSQL server binaries not found (looked in ${BINDIR_ENV}, {DEBIAN_BINDIR} "
        f"and `pg_config --bindir`); {_INSTALL_HINT}"
    )


_VERSION_LINE = re.compile(r"\(PostgreSQL\) (\d+)")


def server_major(bindir: Path) -> int:
    """The major version of the server in ``bindir``, from ``postgres --version``."""
    result = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=False
    )
    match = _VERSION_LINE.search(result.stdout)
    if result.returncode != 0 or match is None:
        raise PostgresSetupError(
            f"{bindir / 'postgres'} --version failed (exit {result.returncode}): "
            f"{(result.stdout + result.stderr).strip()[:500]}"
        )
    return int(match.group(1))


def server_env() -> dict[str, str]:
    """The environment for server commands, without libpq/PG variables.

    ``PGDATA``, ``PGPORT``, ``PGOPTIONS`` and friends from the caller's shell
    would otherwise leak into ``pg_ctl`` and the server.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"  # English messages: start errors are recognised by text
    return env


def server_user() -> str | None:
    """The user to run server commands as: ``postgres`` when we are root, else ourselves."""
    if os.geteuid() != 0:
        return None
    user = os.environ.get("CDCD_PG_USER", "postgres")
    try:
        pwd.getpwnam(user)
    except KeyError:
        raise PostgresSetupError(
            f"running as root and there is no {user!r} system user for PostgreSQL "
            f"(it refuses to run as root); {_INSTALL_HINT}, which creates it"
        ) from None
    return user
