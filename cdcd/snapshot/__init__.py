"""Snapshots: existing rows of captured tables as ``op=r`` envelopes (docs/snapshots.md).

* :mod:`cdcd.snapshot.initial` — the initial snapshot, read from the snapshot
  exported when cdcd creates the slot, before streaming starts at the slot's
  consistent point (``snapshot.mode: initial | initial_only``).
* :mod:`cdcd.snapshot.incremental` — snapshots on demand while streaming
  continues, chunk by chunk between low and high watermarks written to the
  WAL (DBLog), resumable after a crash at the last delivered chunk.
* :mod:`cdcd.snapshot.store` — the signal table: requests, job state and
  progress, kept in the source database.
* :mod:`cdcd.snapshot.rows` — plans, keyset chunks and COPY parsing.
* :mod:`cdcd.snapshot.ranges` — one key range of the initial snapshot: lock,
  check against the plan, COPY (reader threads and worker processes alike).
* :mod:`cdcd.snapshot.workers` — worker processes for the initial snapshot
  (``snapshot.processes``), each with its own connection and producer.
* :mod:`cdcd.snapshot.progress` — per-table metrics and progress log lines.
* :mod:`cdcd.snapshot.request` — ``cdcd snapshot --table``.
"""
