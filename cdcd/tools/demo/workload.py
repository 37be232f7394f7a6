"""The demo's sample tables and the writer that changes them in a background thread."""


from __future__ import annotations

import itertools
import json
import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from cdcd.tools.local.workload import orders_ddl

#: Pause between two workload steps (seconds, uniform): a few changes per
#: second, readable as they scroll.
STEP_PAUSE_S = (0.25, 0.6)

#: The sample schema (SPEC §9's ``orders``, plus customers). ``orders`` has
#: ``REPLICA IDENTITY FULL`` so that updates and deletes carry the whole old
#: row (``before``); ``customers`` keeps the default, where ``before`` only
#: holds the key -- the demo shows both.
SCHEMA_SQL = """
CREATE TABLE customers(
  id serial PRIMARY KEY,
  name text NOT NULL,
  email text NOT NULL,
  tags text[] NOT NULL DEFAULT '{}',
  created_at timestamptz NOT NULL DEFAULT now());
""" + orders_ddl() + """;
ALTER TABLE orders REPLICA IDENTITY FULL;
"""

_NAMES = (
    "Ada Lovelace",
    "Alan Turing",
    "Grace Hopper",
    "Edsger Dijkstra",
    "Barbara Liskov",
    "Donald Knuth",
    "Frances Allen",
    "Ken Thompson",
    "Margaret Hamilton",
    "John Backus",
    "Radia Perlman",
    "Leslie Lamport",
    "Jim Gray",
    "Michael Stonebraker",
)
_TAGS = ("vip", "newsletter", "eu", "us", "wholesale", "returning")
_CHANNELS = ("web", "app", "store")
_NOTES = (None, None, None, "gift wrap", "leave at the door", "call before delivery")
_NEXT_STATUS = {"new": "paid", "paid": "shipped", "shipped": "delivered"}



@dataclass
class WorkloadCounts:
    """What the writer committed, by (table, op): the yardstick for "nothing lost"."""

    changes: Counter[tuple[str, str]] = field(default_factory=Counter)
    transactions: int = 0

    @property
    def total(self) -> int:
        """All row changes committed."""
        return sum(self.changes.values())


class Workload:
    """Writes a steady, varied stream of changes in a background thread.

    A fixed cycle of steps guarantees that inserts, updates, deletes and
    multi-row transactions show up within the first few seconds; the data in
    each step is random. Each step is one transaction; the rows it changed are
    counted (``rowcount``) only after it committed, so the counts can be
    compared with what arrives from Kafka.
    """

    def __init__(self, connect: Callable[[], Any], stop: threading.Event) -> None:
        self._connect = connect
        self._stop = stop
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._counts = WorkloadCounts()
        self._thread = threading.Thread(target=self._run, name="cdcd-demo-writer", daemon=True)
        self.error: BaseException | None = None
        self._cycle = itertools.cycle(
            (
                self._new_order,
                self._advance_order,
                self._new_customer,
                self._new_order,
                self._advance_order,
                self._checkout,
                self._update_customer,
                self._cancel_order,
                self._new_order,
                self._advance_order,
                self._ship_paid_orders,
                self._new_order,
                self._advance_order,
                self._close_account,
            )
        )

    def start(self) -> None:
        """Start writing."""
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (after ``stop`` was set)."""
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the writer thread still runs."""
        return self._thread.is_alive()

    def counts(self) -> WorkloadCounts:
        """A copy of the counts so far (thread-safe)."""
        with self._lock:
            return WorkloadCounts(Counter(self._counts.changes), self._counts.transactions)

    def _run(self) -> None:
        """Thread body: seed, then one step per pause until stopped.

        An exception ends the thread and is kept in ``error``; the demo's main
        loop sees it and stops with that error.
        """
        try:
            conn = self._connect()
            try:
                conn.autocommit = False
                self._transaction(conn, self._seed)
                while not self._stop.wait(self._rng.uniform(*STEP_PAUSE_S)):
                    self._transaction(conn, next(self._cycle))
            finally:
                conn.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = exc

    def _transaction(
        self, conn: Any, step: Callable[[Any, Counter[tuple[str, str]]], None]
    ) -> None:
        """Run ``step`` in one transaction and count its changes once committed."""
        changes: Counter[tuple[str, str]] = Counter()
        with conn.cursor() as cur:
            try:
                step(cur, changes)
            except BaseException:
                conn.rollback()
                raise
        conn.commit()
        changes = +changes  # drop zero counts (an UPDATE that matched nothing)
        if changes:
            with self._lock:
                self._counts.changes.update(changes)
                self._counts.transactions += 1

    # -- steps (each runs inside one transaction) -------------------------------------

    def _seed(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Three customers in one transaction, so orders have someone to belong to."""
        for _ in range(3):
            self._insert_customer(cur, changes)

    def _insert_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> int:
        rng = self._rng
        name = rng.choice(_NAMES)
        email = name.lower().replace(" ", ".") + f"{rng.randint(1, 99)}@example.com"
        tags = rng.sample(_TAGS[:4], rng.randint(0, 2))
        cur.execute(
            "INSERT INTO customers(name, email, tags) VALUES (%s, %s, %s) RETURNING id",
            (name, email, tags),
        )
        changes["public.customers", "c"] += cur.rowcount
        customer_id: int = cur.fetchone()[0]
        return customer_id

    def _random_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> int:
        cur.execute("SELECT id FROM customers ORDER BY random() LIMIT 1")
        row = cur.fetchone()
        if row is None:
            return self._insert_customer(cur, changes)
        customer_id: int = row[0]
        return customer_id

    def _insert_order(self, cur: Any, changes: Counter[tuple[str, str]], customer_id: int) -> None:
        rng = self._rng
        payload = {"items": rng.randint(1, 5), "channel": rng.choice(_CHANNELS)}
        cur.execute(
            "INSERT INTO orders(customer_id, status, amount, note, flags, payload) "
            "VALUES (%s, 'new', %s, %s, %s, %s::jsonb)",
            (
                customer_id,
                Decimal(rng.randint(500, 50_000)) / 100,
                rng.choice(_NOTES),
                rng.random() < 0.3,
                json.dumps(payload),
            ),
        )
        changes["public.orders", "c"] += cur.rowcount

    def _new_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        self._insert_customer(cur, changes)

    def _new_order(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        self._insert_order(cur, changes, self._random_customer(cur, changes))

    def _advance_order(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """One order moves on: new -> paid -> shipped -> delivered."""
        cur.execute(
            "UPDATE orders SET status = CASE status WHEN 'new' THEN 'paid' "
            "WHEN 'paid' THEN 'shipped' ELSE 'delivered' END "
            "WHERE id = (SELECT id FROM orders WHERE status <> 'delivered' "
            "ORDER BY random() LIMIT 1)"
        )
        changes["public.orders", "u"] += cur.rowcount
        if not cur.rowcount:
            self._new_order(cur, changes)

    def _update_customer(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """A customer gets a new tag (an array update), or else a new email address."""
        tag = self._rng.choice(_TAGS)
        cur.execute(
            "UPDATE customers SET tags = tags || %s::text WHERE id = (SELECT id FROM customers "
            "WHERE NOT %s = ANY(tags) ORDER BY random() LIMIT 1)",
            (tag, tag),
        )
        if not cur.rowcount:
            cur.execute(
                "UPDATE customers SET email = replace(email, '@example.com', '@example.org') "
                "WHERE id = (SELECT id FROM customers ORDER BY random() LIMIT 1)"
            )
        changes["public.customers", "u"] += cur.rowcount

    def _cancel_order(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """An unshipped order is cancelled: a delete (and a tombstone in Kafka)."""
        cur.execute(
            "DELETE FROM orders WHERE id = (SELECT id FROM orders "
            "WHERE status IN ('new', 'paid') ORDER BY random() LIMIT 1)"
        )
        changes["public.orders", "d"] += cur.rowcount

    def _checkout(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Multi-row transaction: one customer places several orders at once."""
        customer_id = self._random_customer(cur, changes)
        for _ in range(self._rng.randint(2, 4)):
            self._insert_order(cur, changes, customer_id)
        cur.execute(
            "UPDATE customers SET tags = tags || 'returning'::text "
            "WHERE id = %s AND NOT 'returning' = ANY(tags)",
            (customer_id,),
        )
        changes["public.customers", "u"] += cur.rowcount

    def _ship_paid_orders(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Multi-row transaction: the warehouse ships every paid order in one UPDATE."""
        cur.execute("UPDATE orders SET status = 'shipped' WHERE status = 'paid'")
        changes["public.orders", "u"] += cur.rowcount
        if not cur.rowcount:
            self._checkout(cur, changes)

    def _close_account(self, cur: Any, changes: Counter[tuple[str, str]]) -> None:
        """Multi-row transaction: a customer leaves; their orders go with them."""
        cur.execute("SELECT count(*) FROM customers")
        if cur.fetchone()[0] <= 3:
            self._new_customer(cur, changes)
            return
        customer_id = self._random_customer(cur, changes)
        cur.execute("DELETE FROM orders WHERE customer_id = %s", (customer_id,))
        changes["public.orders", "d"] += cur.rowcount
        cur.execute("DELETE FROM customers WHERE id = %s", (customer_id,))
        changes["public.customers", "d"] += cur.rowcount


# -------------------------------------------------------------------------- consumer
