"""Recorded states and heal requests in the signal table; the log line and metric of a change.

A state is a row of the signal table (``STATE_TYPE``, id
``schema:<slot>:<table>``), written before anything that depends on it. A
heal is an incremental snapshot request written to the signal table in the
same statement that records the new state, so a crash either loses both
(the replayed stream finds the change again) or keeps both (the restarted
daemon resumes the snapshot). The state carries the commit LSN at which it
was first seen: a replay after a crash that meets an *older* shape uses it
as it was (same schema as first published) instead of mistaking it for a
change; a recreated table's truncate is emitted again when its transaction
is replayed.

Without a usable signal table (none configured, or dropped while cdcd runs
and healing is off) states are kept in memory only, and a change that needs
a re-snapshot says so in an error line naming the command that heals it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cdcd.observability.metrics import Metrics
from cdcd.pipeline.schema_changes.classify import SchemaChange
from cdcd.pipeline.schema_changes.state import (
    ADD_DEFAULT,
    RECREATE,
    RENAME,
    ROW_FILTER,
    STATE_TYPE,
    TableState,
)
from cdcd.snapshot.store import (
    HEAL_ID_PREFIX,
    TRUNCATE_FIRST,
    SignalTable,
    SignalTableGone,
    SignalTableUnavailable,
)

log = logging.getLogger("cdcd.schema")


class StateBook:
    """The recorded state of each captured table, and what recording a change does."""

    def __init__(
        self,
        signals: SignalTable | None,
        slot: str,
        resnapshot: bool,
        metrics: Metrics | None = None,
    ) -> None:
        #: None: states live in memory only (see the module docstring).
        self.signals = signals
        self._slot = slot
        self._resnapshot = resnapshot
        self._metrics = metrics
        self.states: dict[str, TableState] = {}
        if signals is not None:
            self._load()

    def _state_id(self, table: str) -> str:
        return f"schema:{self._slot}:{table}"

    def _load(self) -> None:
        assert self.signals is not None
        prefix = f"schema:{self._slot}:"
        rows = self.signals.records(STATE_TYPE, prefix)
        for record_id, data in rows:
            try:
                self.states[record_id[len(prefix) :]] = TableState.from_json(data)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring unreadable schema state %s: %s", record_id, exc)

    def put(self, table: str, change: SchemaChange, truncate_first: bool = False) -> None:
        """Record ``change`` (and its heal, if any) and make its state the table's."""
        self.save(table, change, truncate_first)
        self.states[table] = change.state

    def report(self, table: str, change: SchemaChange) -> None:
        """The change's log line (what changed, what cdcd does about it) and metric."""
        if change.truncate:
            action = "truncate emitted before the new table's first change"
        elif (
            (ROW_FILTER in change.kinds or RECREATE in change.kinds)
            and change.heal
            and self._resnapshot
            and self.signals is not None
        ):
            action = "truncate and re-snapshot started"
        elif change.heal and self._resnapshot and self.signals is not None:
            action = "re-snapshot started"
        elif change.heal:
            action = "re-snapshot skipped"
        elif any(c.default is not None for c in change.state.columns) and ADD_DEFAULT in change.kinds:
            action = "default carried in the schema"
        elif RENAME in change.kinds:
            action = "earlier name kept as an Avro alias"
        else:
            action = "new schema"
        kinds = ",".join(change.kinds)
        log.info(
            "schema change on %s: %s (%s); %s",
            table,
            kinds,
            "; ".join(change.details) or "-",
            action,
            extra={"table": table, "kind": kinds, "action": action},
        )
        if change.heal and not self._resnapshot:
            log.warning(
                "schema change on %s: %s rewrote rows the WAL does not carry; not re-snapshotting "
                "because schema_changes.resnapshot is never: consumers keep old values until "
                "each row changes ('cdcd snapshot --table %s' heals it)",
                table,
                kinds,
                table,
            )
        elif change.heal and self.signals is None:
            log.error(
                "schema change on %s: %s needs a re-snapshot, but there is no usable signal table: "
                "consumers keep old values until each row changes; create the table "
                "(docs/snapshots.md) and run 'cdcd snapshot --table %s'",
                table,
                kinds,
                table,
            )
        if self._metrics is not None:
            for kind in change.kinds:
                self._metrics.schema_change(table, kind)

    def report_kept(self, table: str) -> None:
        log.info(
            "the files of %s changed and it holds rows older than its recorded state "
            "(VACUUM FULL, CLUSTER or SET TABLESPACE): no re-snapshot",
            table,
            extra={"table": table},
        )

    def save(self, table: str, change: SchemaChange, truncate_first: bool = False) -> None:
        """Write the change's state, with its heal request when it heals and healing is on."""
        if self.signals is None:
            return
        heal = None
        if change.heal and self._resnapshot:
            data: dict[str, Any] = {
                "data-collections": [table],
                "type": "incremental",
                "reason": f"schema change: {','.join(change.kinds)}",
            }
            heal_id = f"{HEAL_ID_PREFIX}{self._slot}:{table}:{change.state.lsn}"
            if truncate_first:
                data[TRUNCATE_FIRST] = [table]
            if ROW_FILTER in change.kinds:
                # Found at start, not at a stream position: several may share one lsn.
                heal_id += f":filter:{time.time_ns()}"
            heal = (heal_id, data)
        try:
            self.signals.record(self._state_id(table), STATE_TYPE, change.state.to_json(), heal)
        except SignalTableGone as exc:
            # Dropped while cdcd runs: the recorded states went with it.
            # Create it again when healing is on (the snapshot driver finds
            # it again by itself), else go on in memory.
            if self._resnapshot:
                try:
                    self.signals.ensure()
                    self.signals.record(self._state_id(table), STATE_TYPE, change.state.to_json(), heal)
                    log.warning("%s; created it again, schema states are recorded from now on", exc)
                    return
                except (SignalTableGone, SignalTableUnavailable) as again:
                    exc = again  # type: ignore[assignment]
            log.warning("schema changes are tracked in memory only from now on: %s", exc)
            self.signals = None

