"""The startup plan: what ``cdcd run`` checks and does before it streams, as one list of steps.

``STARTUP_PLAN`` is that list, in order: connect, the server's settings,
the role's REPLICATION privilege, the protocol and failover support, the
signal table's name, a publication shared with another daemon, the
publication (planned, then created or reconciled), the signal table, the slot
(lost, missing, of another kind, in use), the initial snapshot's slot
creation, the slot itself, Kafka (after the slot, so capture starts when cdcd
starts even while the broker is out of reach), the schema registry and the
metrics address.

A session executes it at every start (``Startup(dry_run=False)``): a step
acts, and refuses by raising the error ``run`` exits with. ``cdcd check``
executes the very same steps dry (``dry_run=True``): a step that would change
something (CREATE PUBLICATION, a slot, the signal table) only says what it
would do, and a refusal becomes a FAIL line carrying the same error. So what
``check`` says is what ``run`` does, by construction; ``cdcd check`` adds only
advice that ``run`` does not act on (failover readiness, synchronous
replication, other daemons).

A step reports through :meth:`Startup.report`: lines for ``check``, and in a
session the not-ok ones are logged as warnings (``run`` streams anyway).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cdcd.config.model import CdcdConfig, redact_dsn
from cdcd.errors import CdcdError, ConfigError, DefiniteError
from cdcd.observability.http import parse_listen
from cdcd.pipeline.slot_record import check_slot, remember_slot
from cdcd.pipeline.startup_lines import describe_publication, describe_signal_table
from cdcd.snapshot.daemons import publication_clash
from cdcd.snapshot.initial import ExportedSnapshot, create_slot_with_snapshot
from cdcd.snapshot.rows import published_units
from cdcd.snapshot.store import SignalTable, SignalTableUnavailable
from cdcd.source.database import SourceDatabase
from cdcd.source.markers import MarkerTransactions
from cdcd.source.slot_holder import slot_holder, slot_in_use
from cdcd.source.slots import SlotInfo
from cdcd.source.versions import (
    has_messages,
    max_protocol,
    require_failover,
    require_protocol,
    version_text,
)

if TYPE_CHECKING:
    from cdcd.observability.metrics import Metrics

log = logging.getLogger("cdcd.startup")


@dataclass(frozen=True, slots=True)
class Finding:
    """One line of ``cdcd check``.

    ``config`` marks a failure that a change to the configuration (or to the
    objects it names) must fix: ``check`` then exits 2, as ``run`` would.
    """

    ok: bool
    line: str
    config: bool = False


class Startup:
    """What the plan's steps share: the configuration, the connection, what they found.

    After a (non-dry) run the session reads ``db``, ``include``,
    ``signal_table``, ``signals``, ``slot``, ``exported`` and ``markers``.
    """

    def __init__(
        self,
        config: CdcdConfig,
        *,
        dry_run: bool,
        connect: Callable[[], SourceDatabase],
        check_broker: Callable[[], str],
        stop: threading.Event | None = None,
        beat: Callable[[], None] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.dry_run = dry_run
        self.connect = connect
        self.check_broker = check_broker
        self.stop = stop or threading.Event()
        self.beat = beat or (lambda: None)
        self.metrics = metrics
        self.findings: list[Finding] = []
        self.db: SourceDatabase | None = None
        #: The signal table as configured, whether or not it exists (None: a bad name).
        self.signal_table: SignalTable | None = None
        #: The signal table when it is usable now.
        self.signals: SignalTable | None = None
        #: postgres.tables expanded (and their published leaves); None: the publication's.
        self.tables: set[tuple[str, str]] | None = None
        self.markers: MarkerTransactions | None = None
        #: The slot as the slot state step found it (None: absent).
        self.found_slot: SlotInfo | None = None
        #: Whether the slot state step passed (a lost slot says all there is to say).
        self.slot_checked = False
        self.create_slot = False
        self.slot: SlotInfo | None = None
        self.exported: ExportedSnapshot | None = None

    def report(self, ok: bool, line: str, config: bool = False) -> None:
        """A line for ``check``; in a session only the not-ok ones, logged as warnings."""
        if self.dry_run:
            self.findings.append(Finding(ok, line, config))
        elif not ok:
            log.warning("%s", line)

    @property
    def database(self) -> SourceDatabase:
        assert self.db is not None, "a step that needs the database ran without one"
        return self.db

    @property
    def signal_pair(self) -> tuple[str, str] | None:
        table = self.signal_table
        return None if table is None else (table.schema, table.table)

    def include(self, schema: str, table: str) -> bool:
        """Whether the stream's changes of this table are captured."""
        if (schema, table) == self.signal_pair:
            return False  # the snapshot signal table is cdcd's own bookkeeping
        return self.tables is None or (schema, table) in self.tables

    def captured_tables(self) -> list[tuple[str, str]]:
        """The captured tables as the stream will carry them (leaves of a per-leaf partition)."""
        db, pg = self.database, self.config.postgres
        exists = db.publication_exists(pg.publication)
        exclude = [self.signal_pair] if self.signal_pair else []
        if pg.table_names:
            tables = db.resolve_tables(pg, exclude=exclude)
        elif exists:
            tables = db.publication_tables(pg.publication)
        else:
            return []
        if exists:
            tables = published_units(db, pg.publication, tables)
        return [(s, t) for s, t in tables if self.include(s, t)]


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the plan.

    ``act`` does the step (dry: says what it would do) and raises what ``run``
    refuses. ``label`` prefixes a refusal's line in ``check`` (``{slot}``,
    ``{signal_table}`` filled from the configuration). ``needs_db``: skipped
    without a connection; ``dry_only``: a probe ``run`` does not make before
    streaming (said in its docstring).
    """

    name: str
    act: Callable[[Startup], None]
    label: str = ""
    needs_db: bool = True
    dry_only: bool = False

    def prefix(self, startup: Startup) -> str:
        if not self.label:
            return ""
        config, table = startup.config, startup.signal_table
        text = self.label.format(
            slot=config.postgres.slot,
            signal_table=table.name if table is not None else config.snapshot.signal_table,
        )
        return f"{text}: "


# ----------------------------------------------------------------------------- steps


def _connect(s: Startup) -> None:
    s.db = s.connect()
    if s.dry_run:
        where = redact_dsn(s.config.postgres.dsn.get_secret_value())
        db = s.db
        s.report(True, f"postgres: connected to {db.database} ({where}), server {db.server_version}")


def _server(s: Startup) -> None:
    s.database.require_logical()
    s.report(True, "wal_level: logical")


#: Roles of managed services whose members may replicate without the REPLICATION attribute.
_SERVICE_REPLICATION_ROLES = ("rds_replication", "rds_superuser", "azure_pg_admin")


def _privileges(s: Startup) -> None:
    """The role may create and stream from a replication slot (SUPERUSER or REPLICATION)."""
    db = s.database
    rows = db.query(
        "SELECT r.rolname, r.rolsuper OR r.rolreplication OR EXISTS (SELECT 1 FROM "
        "pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid WHERE m.member = r.oid "
        "AND g.rolname = ANY(%s)) FROM pg_roles r WHERE r.rolname = current_user",
        (list(_SERVICE_REPLICATION_ROLES),),
    )
    if not rows:
        return  # a role that vanished meanwhile: the next statement says so
    role, allowed = rows[0]
    if not allowed:
        raise DefiniteError(
            f"role {role} has neither the REPLICATION nor the SUPERUSER attribute, so it cannot "
            "create or stream from a replication slot",
            hint=f"ALTER ROLE {role} REPLICATION (on a managed service, grant it the service's "
            "replication role), or connect as a role that has it",
        )
    s.report(True, f"privileges: role {role} may create and stream from replication slots")


def _protocol(s: Startup) -> None:
    version, protocol = s.database.server_version, s.config.postgres.protocol_version
    require_protocol(version, protocol)
    if not has_messages(version):
        # PostgreSQL 12, 13: heartbeats and watermarks recognised by xid.
        s.markers = MarkerTransactions()
    if s.dry_run:
        line = (
            f"protocol_version: {protocol} (PostgreSQL {version_text(version)} "
            f"speaks pgoutput protocol {max_protocol(version)} at most)"
        )
        if not has_messages(version):
            line += (
                "; pgoutput sends no logical messages before 14: heartbeats and snapshot "
                "watermarks are recognised by transaction id"
            )
        s.report(True, line)


def _failover(s: Startup) -> None:
    require_failover(s.database.server_version, s.config.postgres.failover)


def _status_interval(s: Startup) -> None:
    interval = s.config.postgres.status_interval_s
    timeout = s.database.wal_sender_timeout_s()
    if timeout and interval >= timeout / 2:
        s.report(
            False,
            f"status_interval_s: {interval} is not below wal_sender_timeout/2 "
            f"({timeout / 2:.1f} s); lower postgres.status_interval_s (the server may drop "
            "the connection)",
        )
    else:
        s.report(True, f"status_interval_s: {interval} < wal_sender_timeout/2")


def _signal_table_name(s: Startup) -> None:
    s.signal_table = SignalTable(s.database, s.config.snapshot.signal_table)


def _shared_publication(s: Startup) -> None:
    """Another live daemon's tables, which making the publication ours would drop."""
    if s.signal_table is None:
        return  # a bad name (dry: said by its step): no records to compare with
    publication_clash(s.database, s.config.postgres, s.config.snapshot.signal_table)


def _publication(s: Startup) -> None:
    db, pg = s.database, s.config.postgres
    exclude = [s.signal_pair] if s.signal_pair else []
    if s.dry_run:
        plan = db.plan_publication(pg, exclude=exclude)
        describe_publication(s, plan)
    else:
        if pg.table_names:
            s.tables = set(db.resolve_tables(pg, exclude=exclude))
        db.ensure_publication(pg, exclude=exclude)
    if s.tables is not None:
        # A partitioned table published per leaf: the stream carries its leaves.
        s.tables |= set(published_units(db, pg.publication, sorted(s.tables)))


def _signal_table(s: Startup) -> None:
    """The signal table: used if there, created when a feature needs it (see below)."""
    table = s.signal_table
    if table is None:
        return
    cfg = s.config
    if cfg.schema_changes.resnapshot == "auto" and not s.dry_run:
        # Healing a rewrite is an incremental snapshot, and table states must
        # outlive the process: both live in the signal table.
        try:
            table.ensure()
        except SignalTableUnavailable as exc:
            log.warning(
                "schema changes are tracked in memory only and rewrites are not healed: %s (%s)",
                exc,
                exc.hint,
            )
    if s.dry_run:
        describe_signal_table(s, table)


def _slot_state(s: Startup) -> None:
    """An invalidated slot, or one missing where cdcd streamed before, is lost: refused
    (exit 3, 'cdcd resync'), never silently created anew."""
    pg = s.config.postgres
    s.found_slot = check_slot(s.database, s.signal_table, pg.slot)
    s.create_slot = pg.create_slot and s.found_slot is None
    s.slot_checked = True


def _initial_snapshot(s: Startup) -> None:
    """The signal table is created only when a feature needs it: here the crash-safe
    initial snapshot of a slot this session creates (refused rather than copied
    without a record). Otherwise it is used if it is there, and the incremental
    snapshot driver looks for it while streaming (``cdcd snapshot`` creates it)."""
    cfg, table = s.config, s.signal_table
    pg, snap = cfg.postgres, cfg.snapshot
    if table is None:
        return
    initial = s.create_slot and snap.mode != "never"
    if initial:
        obstacle = None if table.exists() else table.cannot_create()
        if obstacle is not None:
            raise SignalTableUnavailable(
                f"cannot create the signal table {table.name} ({obstacle}): the initial "
                f"snapshot (snapshot.mode {snap.mode}) records its progress there, so cdcd "
                "exits 3 before creating the slot",
                hint="create it as a user allowed to and grant SELECT, INSERT, UPDATE "
                "(docs/snapshots.md), or set snapshot.mode never",
            )
        if s.dry_run:
            return
        table.ensure()
        s.signals = table
    elif not s.dry_run and table.exists():
        try:
            table.check_layout()
            s.signals = table
        except SignalTableUnavailable:
            pass  # the driver warns once and waits for it to be fixed
    if s.dry_run or not s.create_slot or s.signals is None:
        return
    signals = s.signals
    if snap.mode == "never":
        signals.cancel_initial(pg.slot, "the slot was created again with snapshot.mode never")
        return
    tables = s.captured_tables()
    # Recorded before the slot exists: no crash can leave the slot without a
    # record that its snapshot is unfinished.
    signals.begin_initial(pg.slot, [f"{schema}.{name}" for schema, name in tables])
    s.exported = create_slot_with_snapshot(
        pg.dsn.get_secret_value(),
        pg.slot,
        pg.protocol_version >= 3,
        # Worker processes import the snapshot themselves: the daemon only plans.
        1 if snap.processes else snap.parallelism,
        pg.connect_timeout_s,
        beat=s.beat,
        stop=s.stop,
    )


def missing_slot_error(slot: str) -> DefiniteError:
    return DefiniteError(
        f"replication slot {slot} does not exist",
        hint="set postgres.create_slot: true or create it with "
        f"pg_create_logical_replication_slot('{slot}', 'pgoutput')",
    )


def _slot(s: Startup) -> None:
    """The slot: created if missing and allowed, verified, not held by another client."""
    db, pg = s.database, s.config.postgres
    two_phase = pg.protocol_version >= 3
    if not s.slot_checked:
        return  # dry: the slot state step said why it is lost
    if s.found_slot is None and not s.create_slot:
        raise missing_slot_error(pg.slot)
    if s.dry_run:
        info = s.found_slot
        if info is None:
            s.report(True, f"slot {pg.slot}: absent, will be created (create_slot: true)")
            return
        db.verify_slot(info, two_phase)
        if info.active_pid:
            raise slot_in_use(pg.slot, slot_holder(db, info.active_pid))
        kind = ", failover" if info.failover else ""
        if pg.failover and not info.failover:
            kind = ", not a failover slot yet (`cdcd run` makes it one)"
        s.report(
            True, f"slot {pg.slot}: pgoutput{kind}, confirmed {info.confirmed_flush_lsn}, inactive"
        )
        return
    slot = s.slot = db.ensure_slot(
        pg.slot, pg.create_slot, two_phase=two_phase, failover=pg.failover, beat=s.beat, stop=s.stop
    )
    if slot.active_pid is not None and s.exported is None:
        # Said before Kafka is set up, with who holds it: START_REPLICATION
        # would fail the same way, naming only a PID.
        raise slot_in_use(pg.slot, slot_holder(db, slot.active_pid))
    remember_slot(s.signals, slot)
    if s.metrics is not None and slot.inactive_since is not None:
        # How long nobody streamed from it (PostgreSQL 18 may invalidate it for that).
        s.metrics.slot_inactive_since.set(slot.inactive_since.timestamp())


def _kafka(s: Startup) -> None:
    description = s.check_broker()
    s.report(True, f"kafka: {description}")


def _registry(s: Startup) -> None:
    """Dry only: ``run`` meets the registry when it registers the first schema."""
    registry = s.config.schema_registry
    if not registry.url:
        return
    from cdcd.envelope.wire import registry_client

    try:
        subjects = registry_client(registry.url, registry.config).get_subjects()
    except CdcdError:
        raise
    except Exception as exc:  # noqa: BLE001 - any client failure is a failed check, reported
        s.report(False, f"schema registry: unreachable ({type(exc).__name__}: {exc})")
        return
    s.report(True, f"schema registry: reachable, {len(subjects)} subjects")


def _metrics_listen(s: Startup) -> None:
    """Dry only: the daemon binds ``metrics.listen`` before its first session."""
    listen = s.config.metrics.listen
    problem = bind_problem(listen)
    if problem is not None:
        raise listen_error(listen, problem)
    s.report(True, f"metrics.listen {listen}: free")


#: The plan, in the order ``run`` executes it.
STARTUP_PLAN: tuple[Step, ...] = (
    Step("connect", _connect, label="postgres", needs_db=False),
    Step("server", _server, label="wal_level"),
    Step("privileges", _privileges, label="privileges"),
    Step("protocol", _protocol, label="protocol_version"),
    Step("failover", _failover, label="failover"),
    Step("status interval", _status_interval),
    Step("signal table name", _signal_table_name, label="signal table {signal_table}"),
    Step("shared publication", _shared_publication),
    Step("publication", _publication),
    Step("signal table", _signal_table),
    Step("slot state", _slot_state, label="slot {slot}"),
    Step("initial snapshot", _initial_snapshot, label="signal table {signal_table}"),
    Step("slot", _slot, label="slot {slot}"),
    # After the slot: capture starts when cdcd starts, even while Kafka is out
    # of reach (the slot keeps every change until it is delivered).
    Step("kafka", _kafka, label="kafka", needs_db=False),
    Step("schema registry", _registry, needs_db=False, dry_only=True),
    Step("metrics", _metrics_listen, label="metrics.listen", needs_db=False, dry_only=True),
)


def sub_plan(*names: str) -> tuple[Step, ...]:
    """The steps of ``STARTUP_PLAN`` named ``names``, in the plan's order (``cdcd resync``'s checks)."""
    unknown = set(names) - {step.name for step in STARTUP_PLAN}
    assert not unknown, f"no such startup steps: {sorted(unknown)}"
    return tuple(step for step in STARTUP_PLAN if step.name in names)


def execute(startup: Startup, plan: tuple[Step, ...] = STARTUP_PLAN) -> None:
    """Run the plan for real (a session's start): every step in order; a refusal propagates."""
    assert not startup.dry_run
    for step in plan:
        if not step.dry_only:
            step.act(startup)


def dry_run(
    startup: Startup,
    on_error: Callable[[Step, CdcdError], Finding],
    plan: tuple[Step, ...] = STARTUP_PLAN,
) -> Iterator[tuple[Step, list[Finding]]]:
    """Run the plan dry (``cdcd check``): each step and the lines it gave.

    A refusal becomes a line (``on_error``) and the plan goes on, so one
    ``check`` reports every problem ``run`` would meet one start at a time;
    without a connection the steps that need one are left out.
    """
    assert startup.dry_run
    for step in plan:
        if step.needs_db and startup.db is None:
            continue
        startup.findings = []
        try:
            step.act(startup)
        except CdcdError as exc:
            startup.findings.append(on_error(step, exc))
        yield step, startup.findings


def refusal_line(step: Step, startup: Startup, exc: CdcdError) -> Finding:
    """A refusal as ``check`` prints it: the step's label, then the error ``run`` exits with."""
    text = str(exc)
    prefix = step.prefix(startup)
    if text.startswith(prefix.rstrip(": ")):
        prefix = ""  # the error names it already ("slot x is active for PID ...")
    return Finding(False, f"{prefix}{text}", config=isinstance(exc, ConfigError))


# ----------------------------------------------------------------------------- metrics.listen


def listen_error(listen: str, problem: str) -> ConfigError:
    """What ``run`` (and ``check``) say of a ``metrics.listen`` that cannot be bound."""
    return ConfigError(
        f"metrics.listen {listen}: cannot listen there ({problem})",
        hint="choose a free local address for metrics.listen",
    )


def describe_bind_error(host: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{exc.strerror}: another process listens there (a cdcd already running?)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{exc.strerror}: {host} is not an address of this host"
    return exc.strerror or str(exc)


def bind_problem(listen: str) -> str | None:
    """Why ``listen`` cannot be bound now, or None; binds like the server does, then lets go."""
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"{host}: {exc.strerror or exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the HTTP server: reuse a port in TIME_WAIT, accept IPv4 on [::].
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and address[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            sock.bind(address)
        except OSError as exc:
            return describe_bind_error(host, exc)
    return None
