"""A seeded random OLTP workload over three tables, for end-to-end tests.

Tables (each shaped to exercise something different):

* ``accounts(id int PK, owner text, balance numeric(12,2), note text)`` —
  updates, deletes, primary key changes.
* ``items(sku text, warehouse int, qty int, tags text[], PK(sku, warehouse))`` —
  a composite key.
* ``ledger(id bigserial PK, account int, amount numeric, memo text)`` with
  ``REPLICA IDENTITY FULL`` — whole old rows in updates and deletes.

Transactions are committed, rolled back (their rows carry the ``ABORTED``
marker so tests can prove nothing of them was published), or use savepoints
rolled back half-way (marker ``SAVEPOINT-UNDONE``). ``truncate=True`` adds a
TRUNCATE of ``ledger`` at a random point.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg2.extensions

ABORTED = "ABORTED"
UNDONE = "SAVEPOINT-UNDONE"

SCHEMA = """
CREATE TABLE accounts(id int PRIMARY KEY, owner text NOT NULL, balance numeric(12,2) NOT NULL,
                      note text);
CREATE TABLE items(sku text, warehouse int, qty int NOT NULL, tags text[],
                   PRIMARY KEY (sku, warehouse));
CREATE TABLE ledger(id bigserial PRIMARY KEY, account int NOT NULL, amount numeric NOT NULL,
                    memo text);
ALTER TABLE ledger REPLICA IDENTITY FULL;
"""

KEYS = {"accounts": ("id",), "items": ("sku", "warehouse"), "ledger": ("id",)}


@dataclass
class Workload:
    seed: int
    rng: random.Random = field(init=False)
    next_account: int = 1
    committed: int = 0
    aborted: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def create(self, conn: psycopg2.extensions.connection) -> None:
        with conn.cursor() as cur:
            cur.execute(SCHEMA)
        if not conn.autocommit:
            conn.commit()

    def _statement(self, cur: Any, marker: str | None) -> None:
        rng = self.rng
        choice = rng.random()
        note = marker or f"n{rng.randrange(10**6)}"
        if choice < 0.30:
            self.next_account += 1
            cur.execute(
                "INSERT INTO accounts VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                (self.next_account * 7 + rng.randrange(7), f"o{rng.randrange(100)}",
                 rng.randrange(-10**6, 10**6) / 100, note),
            )
        elif choice < 0.45:
            cur.execute(
                "UPDATE accounts SET balance = balance + %s, note = %s WHERE id IN "
                "(SELECT id FROM accounts ORDER BY random() LIMIT 2)",
                (rng.randrange(-1000, 1000) / 100, note),
            )
        elif choice < 0.50:
            # Primary key change (avoid collisions with a large offset).
            cur.execute(
                "UPDATE accounts SET id = id + 1000000, note = %s WHERE id = "
                "(SELECT id FROM accounts WHERE id < 1000000 ORDER BY random() LIMIT 1)",
                (note,),
            )
        elif choice < 0.56:
            cur.execute(
                "DELETE FROM accounts WHERE id = (SELECT id FROM accounts ORDER BY random() LIMIT 1)"
            )
        elif choice < 0.72:
            cur.execute(
                "INSERT INTO items VALUES (%s, %s, %s, %s) ON CONFLICT (sku, warehouse) "
                "DO UPDATE SET qty = items.qty + EXCLUDED.qty, tags = EXCLUDED.tags",
                (f"sku-{rng.randrange(300)}", rng.randrange(3), rng.randrange(1, 50),
                 [note, f"t{rng.randrange(9)}"] if rng.random() < 0.8 else None),
            )
        elif choice < 0.78:
            cur.execute(
                "DELETE FROM items WHERE (sku, warehouse) IN "
                "(SELECT sku, warehouse FROM items ORDER BY random() LIMIT 1)"
            )
        elif choice < 0.92:
            cur.execute(
                "INSERT INTO ledger(account, amount, memo) VALUES (%s, %s, %s)",
                (rng.randrange(1000), str(rng.randrange(-10**9, 10**9)) + ".0" + str(rng.randrange(10)),
                 note),
            )
        elif choice < 0.97:
            cur.execute(
                "UPDATE ledger SET memo = %s WHERE id = (SELECT id FROM ledger ORDER BY random() LIMIT 1)",
                (note,),
            )
        else:
            cur.execute(
                "DELETE FROM ledger WHERE id = (SELECT id FROM ledger ORDER BY random() LIMIT 1)"
            )

    def transaction(self, conn: psycopg2.extensions.connection, truncate: bool = False) -> None:
        """One random transaction; conn must not be in autocommit mode."""
        rng = self.rng
        kind = rng.random()
        with conn.cursor() as cur:
            if truncate:
                cur.execute("TRUNCATE ledger")
            if kind < 0.08:
                for _ in range(rng.randrange(1, 6)):
                    self._statement(cur, ABORTED)
                conn.rollback()
                self.aborted += 1
                return
            for _ in range(rng.randrange(1, 8)):
                self._statement(cur, None)
            if kind < 0.2:
                cur.execute("SAVEPOINT s1")
                for _ in range(rng.randrange(1, 4)):
                    self._statement(cur, UNDONE)
                cur.execute("ROLLBACK TO SAVEPOINT s1")
                self._statement(cur, None)
        conn.commit()
        self.committed += 1

    @contextmanager
    def writing(self, conn: psycopg2.extensions.connection, pause_s: float) -> Iterator[None]:
        """Transactions on ``conn`` from a thread while the block runs, ``pause_s`` apart.

        The thread stops (its open transaction rolled back) when the block
        ends; a block that ends normally then fails on any error the writer met.
        """
        stop = threading.Event()
        failures: list[BaseException] = []

        def write() -> None:
            conn.autocommit = False
            try:
                while not stop.is_set():
                    self.transaction(conn)
                    time.sleep(pause_s)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                failures.append(exc)
            finally:
                conn.rollback()
                conn.autocommit = True

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            yield
        finally:
            stop.set()
            writer.join(30)
        assert not failures, failures

    def run(self, conn: psycopg2.extensions.connection, transactions: int, truncate_at: int | None = None) -> None:
        conn.autocommit = False
        for i in range(transactions):
            self.transaction(conn, truncate=(i == truncate_at))
        conn.autocommit = True


def table_rows(conn: psycopg2.extensions.connection, table: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """The table as {key: row}, with the values psycopg2 gives (comparable to fastavro's)."""
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table}")
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return {tuple(row[k] for k in KEYS[table]): row for row in rows}
