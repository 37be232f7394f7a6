"""``cdcd local up | down``: the demo's PostgreSQL and broker, kept running for one's own tables.

``up`` starts a PostgreSQL cluster (database ``app``) and a tansu broker
(in-memory storage: its topics are gone when it stops) on free loopback
ports, leaves both running after the command exits, and writes what is
needed to stop them later (``local.json``) and a configuration that works
with them (``cdcd.yaml``) into one directory. ``down`` stops exactly the two
processes recorded there and removes their directories and the record.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdcd.errors import CdcdError, ConfigError
from cdcd.tools.local.broker import BrokerSetupError, LocalBroker
from cdcd.tools.local.postgres import LocalPostgres, PostgresSetupError
from cdcd.tools.local.process import pid_alive

__all__ = ["DATABASE", "Kept", "cmd_local", "down", "up"]

DATABASE = "app"
STATE_FILE = "local.json"
CONFIG_FILE = "cdcd.yaml"


@dataclass(frozen=True)
class Kept:
    """What ``up`` started."""

    dsn: str
    bootstrap_servers: str
    config_path: Path
    config_text: str
    version: int


class AlreadyUp(RuntimeError):
    """The directory records servers that still run."""


def _config_text(dsn: str, bootstrap: str) -> str:
    # JSON strings are valid YAML scalars: the DSN's spaces and '=' need quoting.
    return (
        "# Written by 'cdcd local up'. Add postgres.tables to capture only some tables.\n"
        "postgres:\n"
        f"  dsn: {json.dumps(dsn)}\n"
        "  slot: cdcd\n"
        "  publication: cdcd\n"
        "kafka:\n"
        f"  bootstrap_servers: {json.dumps(bootstrap)}\n"
        "  topic_prefix: local\n"
        "  partitions: 3\n"
        "snapshot:\n"
        "  mode: initial\n"
        "metrics:\n"
        '  listen: "127.0.0.1:0"\n'
    )


def up(directory: Path) -> Kept:
    """Start both servers, detach them, and write ``local.json`` and ``cdcd.yaml``."""
    directory.mkdir(parents=True, exist_ok=True)
    state_path = directory / STATE_FILE
    if state_path.exists():
        recorded = json.loads(state_path.read_text(encoding="utf-8"))
        if pid_alive(int(recorded["broker"].get("pid") or 0)) or pid_alive(
            int(recorded["postgres"].get("pid") or 0)
        ):
            raise AlreadyUp(f"{directory} already has servers running")
    pg = LocalPostgres.start()
    try:
        broker = LocalBroker.start()
    except BaseException:
        pg.cleanup()
        raise
    try:
        pg.create_database(DATABASE)
    except BaseException:
        broker.cleanup()
        pg.cleanup()
        raise
    dsn = pg.dsn(DATABASE)
    version = pg.version
    state: dict[str, Any] = {"postgres": pg.detach(), "broker": broker.detach(), "dsn": dsn}
    state_path.write_text(json.dumps(state, indent=2), encoding="utf-8")
    text = _config_text(dsn, broker.bootstrap_servers)
    config_path = directory / CONFIG_FILE
    config_path.write_text(text, encoding="utf-8")
    return Kept(dsn, broker.bootstrap_servers, config_path, text, version)


def down(directory: Path) -> bool:
    """Stop what ``up`` recorded in ``directory``; False if nothing was recorded there."""
    state_path = directory / STATE_FILE
    if not state_path.exists():
        return False
    state = json.loads(state_path.read_text(encoding="utf-8"))
    try:
        LocalBroker.stop_detached(state["broker"])
    finally:
        LocalPostgres.stop_detached(state["postgres"])
    state_path.unlink()
    (directory / CONFIG_FILE).unlink(missing_ok=True)
    return True


def cmd_local(args: argparse.Namespace) -> int:
    """``cdcd local up|down [--dir DIR]``: see the module docstring."""
    directory = Path(args.dir)
    if args.action == "down":
        if not down(directory):
            raise ConfigError(
                f"nothing to stop: {directory} holds no servers started by 'cdcd local up'",
                hint="pass the --dir given to 'cdcd local up'",
            )
        print(f"stopped the local PostgreSQL and broker of {directory}, removed their data")
        return 0
    try:
        kept = up(directory)
    except AlreadyUp as exc:
        raise ConfigError(str(exc), hint=f"'cdcd local down --dir {directory}' first") from exc
    except (PostgresSetupError, BrokerSetupError) as exc:
        raise CdcdError(f"cdcd local: {exc}") from exc
    print(f"PostgreSQL {kept.version}: {kept.dsn}")
    print(f"Kafka-compatible broker (in memory): {kept.bootstrap_servers}")
    print(f"Both keep running. Configuration for them, written to {kept.config_path}:")
    print()
    print(kept.config_text)
    print("Next: create your tables (psql \"" + kept.dsn + "\"), then")
    print(f"  cdcd check -c {kept.config_path} && cdcd run -c {kept.config_path}")
    print(f"  cdcd tail -c {kept.config_path} --from beginning    # in another terminal")
    print(f"Stop both and remove their data: cdcd local down --dir {directory}")
    return 0

