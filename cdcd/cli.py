"""Command line (README, docs/operations.md): ``cdcd run | check | schemas | demo | bench | mirror | snapshot | resync``.

Errors are one line on stderr naming the field, table or server and what to
do; ``--debug`` adds the traceback. Exit codes (``CdcdError.exit_code``): 0 ok,
1 runtime failure a restart may cure, 2 usage or configuration error, 3 definite
runtime error that needs an operator (``DefiniteError``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import traceback
from collections.abc import Callable, Sequence

from cdcd import __version__
from cdcd.config.model import CdcdConfig, load_config
from cdcd.errors import CdcdError, ConfigError

log = logging.getLogger("cdcd.cli")


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}", hint=f"see '{self.prog} --help'")


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, metavar="FILE", help="YAML configuration")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cdcd", description="PostgreSQL change data capture to Kafka")
    parser.add_argument("--version", action="version", version=f"cdcd {__version__}")
    parser.add_argument("--debug", action="store_true", help="tracebacks and debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run the daemon until SIGTERM/SIGINT")
    _config_arg(run)
    check = sub.add_parser("check", help="validate the file and the environment")
    _config_arg(check)
    schemas = sub.add_parser("schemas", help="print the key and value Avro schemas per table")
    _config_arg(schemas)
    demo = sub.add_parser("demo", help="throwaway PostgreSQL + broker + sample workload")
    demo.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    bench = sub.add_parser(
        "bench", help="throughput, latency and memory on a fixed workload (docs/performance.md)"
    )
    from cdcd.tools.bench import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    mirror = sub.add_parser("mirror", help="keep Delta Lake mirrors of the tables with Spark")
    _config_arg(mirror)
    mirror.add_argument(
        "--output", required=True, metavar="DIR|URI", help="a local directory or object-store URI"
    )
    mirror.add_argument("--once", action="store_true", help="catch up, then exit")
    mirror.add_argument(
        "--history", action="store_true",
        help="also keep every version of every row (SCD type 2) in DIR/<schema>.<table>/_history",
    )  # fmt: skip
    mirror.add_argument(
        "--bulk-rows", type=int, default=None, metavar="N",
        help="a batch bringing a table at least N new rows (or N changes and a quarter of "
        "its rows) is written by the Spark executors, not collected to the driver "
        "(default 100000; 0: never)",
    )  # fmt: skip
    mirror.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="a delta-rs storage option for an object-store --output (repeatable)",
    )  # fmt: skip
    mirror.add_argument(
        "--checkpoint", metavar="DIR",
        help="Spark's checkpoint (default DIR/.cdcd-mirror/checkpoint; needed for a URI --output)",
    )  # fmt: skip
    mirror.add_argument(
        "--optimize", action="store_true", help="compact the tables, Z-order by key, and exit"
    )
    mirror.add_argument(
        "--vacuum", action="store_true", help="delete files old versions no longer need, and exit"
    )
    mirror.add_argument(
        "--retention-hours", type=int, default=168, metavar="H",
        help="--vacuum keeps the files of the versions of the last H hours (default 168)",
    )  # fmt: skip
    snapshot = sub.add_parser("snapshot", help="request an incremental snapshot of a table")
    _config_arg(snapshot)
    snapshot.add_argument("--table", required=True, action="append", metavar="SCHEMA.TABLE")
    local = sub.add_parser(
        "local", help="start (up) or stop (down) a local PostgreSQL and broker that keep running"
    )
    local.add_argument("action", choices=("up", "down"))
    local.add_argument(
        "--dir", default="cdcd-local", metavar="DIR",
        help="where their record and a ready cdcd.yaml are written (default ./cdcd-local)",
    )  # fmt: skip
    tail = sub.add_parser("tail", help="print the changes in the table topics, decoded")
    _config_arg(tail)
    tail.add_argument(
        "--table", action="append", default=[], metavar="SCHEMA.TABLE",
        help="only this table's topic (repeatable; default: every captured table)",
    )  # fmt: skip
    tail.add_argument(
        "--from", dest="start", choices=("beginning", "end"), default="end",
        help="start at the beginning of the topics, or show only new changes (default)",
    )  # fmt: skip
    tail.add_argument("--json", action="store_true", help="one JSON object per line")
    tail.add_argument(
        "--exit-at-end", action="store_true",
        help="stop once every partition was read to its current end",
    )  # fmt: skip
    resync = sub.add_parser(
        "resync",
        help="after a lost or invalidated slot: a new slot and a snapshot of every table",
    )
    _config_arg(resync)
    # --debug is accepted after the subcommand too (``cdcd run -c FILE --debug``).
    for command in sub.choices.values():
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="tracebacks"
        )
    return parser


def _setup_logging(config: CdcdConfig | None, debug: bool) -> None:
    from cdcd.observability.logging import setup_logging

    if config is None:
        setup_logging("text", "DEBUG" if debug else "INFO")
    else:
        setup_logging(config.metrics.log_format, "DEBUG" if debug else config.metrics.log_level)


def cmd_run(args: argparse.Namespace) -> int:
    from cdcd.daemon import Daemon

    config = load_config(args.config)
    _setup_logging(config, args.debug)
    # One line, secrets masked: what this process runs with, for the record.
    log.info("configuration %s", json.dumps(config.redacted(), sort_keys=True))
    daemon = Daemon(config)
    daemon.install_signal_handlers()
    return daemon.run()


def cmd_schemas(args: argparse.Namespace) -> int:
    from cdcd.check import table_schemas

    config = load_config(args.config)
    for entry in table_schemas(config):
        print(json.dumps(entry, indent=2))
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from cdcd.snapshot.request import request_snapshot

    config = load_config(args.config)
    job_id, signals = request_snapshot(config, list(args.table))
    print(
        f"requested incremental snapshot {job_id} of {', '.join(args.table)}; "
        f"progress: SELECT status, progress FROM {signals.name} WHERE id = '{job_id}'"
    )
    return 0


def cmd_resync(args: argparse.Namespace) -> int:
    from cdcd.pipeline.resync import resync

    config = load_config(args.config)
    result = resync(config)
    if result.dropped:
        print(f"dropped slot {result.slot}: {result.dropped}")
    print(
        f"{'created' if result.created else 'kept the healthy'} slot {result.slot}: "
        f"the stream starts after {result.start}"
    )
    if result.job_id is None:
        print("no captured tables: nothing to snapshot")
        return 0
    print(
        f"published a truncate (op=t) just below {result.start} for each of {len(result.tables)} "
        "tables: "
        "consumers drop what they hold, including rows deleted while the slot was lost"
    )
    print(
        f"requested incremental snapshot {result.job_id} of {', '.join(result.tables)}; "
        f"start the daemon (cdcd run -c {args.config}) to run it while streaming; progress: "
        f"SELECT status, progress FROM {result.signal_table} WHERE id = '{result.job_id}'"
    )
    return 0


# The optional dependencies of each command, by top-level module, with the
# extra that installs them (pyproject.toml). Only these may be missing: any
# other ImportError is a broken installation or a bug and propagates as is.
_EXTRAS: dict[str, tuple[str, frozenset[str]]] = {
    "mirror": ("spark", frozenset({"pyspark", "pyarrow", "pandas", "deltalake"})),
}


def _missing_extra(name: str, exc: ImportError) -> ConfigError | None:
    """A ConfigError if ``exc`` is one of command ``name``'s optional dependencies missing."""
    extra = _EXTRAS.get(name)
    if extra is None or exc.name is None:
        return None
    module = exc.name.partition(".")[0]
    if module not in extra[1]:
        return None
    if isinstance(exc, ModuleNotFoundError) and exc.name == module:
        return ConfigError(
            f"cdcd {name} needs {module}", hint=f"install it with: pip install 'cdcd[{extra[0]}]'"
        )
    # Installed, but not a version cdcd works with (a submodule or name is missing).
    return ConfigError(
        f"cdcd {name} cannot use the installed {module}: {exc}",
        hint=f"install a supported version with: pip install 'cdcd[{extra[0]}]'",
    )


def _lazy(name: str, module: str, attr: str) -> Callable[[argparse.Namespace], int]:
    """Command ``name`` from ``module``, imported when it runs (they are heavy)."""

    def command(args: argparse.Namespace) -> int:
        try:
            run: Callable[[argparse.Namespace], int] = getattr(
                importlib.import_module(module), attr
            )
            return run(args)
        except ImportError as exc:
            missing = _missing_extra(name, exc)
            if missing is None:
                raise
            raise missing from exc

    return command


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": cmd_run,
        "check": _lazy("check", "cdcd.tools.check", "cmd_check"),
        "schemas": cmd_schemas,
        "snapshot": cmd_snapshot,
        "resync": cmd_resync,
        "demo": _lazy("demo", "cdcd.tools.demo", "cmd_demo"),
        "tail": _lazy("tail", "cdcd.tail", "cmd_tail"),
        "local": _lazy("local", "cdcd.tools.local.keep", "cmd_local"),
        "bench": _lazy("bench", "cdcd.tools.bench", "cmd_bench"),
        "mirror": _lazy("mirror", "cdcd.spark.cli", "cmd_mirror"),
    }
    return commands[name]


def _flush_kafka_reports() -> None:
    """Counts of repeated Kafka client errors, logged before the final error line."""
    reporter = sys.modules.get("cdcd.sink.reporter")  # imported only if Kafka was used
    if reporter is not None:
        reporter.flush_kafka_reports()


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    try:
        args = build_parser().parse_args(args_list)
        if args.command not in ("run",):
            _setup_logging(None, debug)
        try:
            return _command(args.command)(args)
        finally:
            _flush_kafka_reports()
    except CdcdError as exc:
        if debug:
            traceback.print_exc()
        print(f"cdcd: error: {exc}".replace("\n", " "), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
