"""``cdcd bench``: the benchmark of SPEC §9, in one run.

Phases, all on the same fixed, seeded workload (``orders``, SPEC §9):

1. **Load.** Two slots are created *before* the load (one for
   ``pg_recvlogical``, one for cdcd), then ``rows`` rows are inserted in
   transactions of 10, so both consumers later drain exactly the same WAL.
   The load session uses ``synchronous_commit=off`` (it does not change the
   WAL, only how fast the load finishes).
2. **Ceiling.** ``pg_recvlogical`` drains its slot with pgoutput (protocol 1)
   to /dev/null up to the end of the load: the raw rate one walsender
   decodes at, which no pgoutput consumer can beat. The walsender's CPU
   (utime + stime from ``/proc/<pid>/stat``, pid from the slot's
   ``active_pid``) over the rows is ``walsender_cpu_us_per_row``.
2b. **Decode ceiling.** ``pg_logical_slot_peek_binary_changes`` on
   ``cdcd_bench_peek``, a copy of the ceiling slot made before the load, with
   the same pgoutput options: the server decoding the same WAL with no client
   at all (wall time, and the backend's CPU from ``/proc/<pid>/sched``).
3. **cdcd end to end.** The real pipeline drains its slot: decode, envelope,
   produce with ``acks=all``, delivery reports, LSN confirmed. The rate is
   rows divided by the time from the session's start until the slot's
   ``confirmed_flush_lsn`` reaches the end of the load. The CPU of this
   process over exactly that drain, all threads (the session, librdkafka's,
   the metrics server) but the bench's own main thread, over the rows is
   ``cdcd_cpu_us_per_row``; the host-independent figure (see
   docs/performance.md).
3b. **Initial snapshot** (skip with ``--no-snapshot``). A session with
   ``snapshot.mode: initial_only`` copies the loaded table (``rows`` rows)
   on a new slot: rows/s and CPU per row from the snapshot's first read to
   its last acknowledgement, for cdcd and for the server backends that read.
   Then the ``COPY … TO STDOUT`` ceiling: the same table copied to /dev/null
   on as many connections as the snapshot reads with, and the server's CPU
   per row during it. The walsender's CPU per row while serving cdcd gives
   ``walsender_limit_rows_per_s``; ``ratio_*`` keys compare cdcd with each
   ceiling (docs/bench.md).
4. **Latency.** ``pgbench`` offers a fixed load (default 10,000 rows/s as
   1,000 transactions/s of 10 rows, ``synchronous_commit=on``) while the
   pipeline runs; for every transaction cdcd records commit time (from the
   server) to the moment Kafka acknowledged its last message and everything
   before it. p50/p99/max over the run, after a warm-up.
5. **Memory.** ``cdcd run`` as its own process through one transaction of
   ``big_rows`` rows; its peak RSS (VmHWM) is reported.
6. **Synchronous capture** (``synchronous``; skip with ``--no-synchronous``,
   or run alone with ``--only synchronous``). cdcd streams a table of its own
   (slot ``cdcd_bench_sync``, named in ``synchronous_standby_names`` by its
   default ``application_name``) while one connection commits single-row
   INSERTs at a fixed rate (``--sync-commits-per-s``, default 200/s, for
   ``--sync-seconds`` each): into the captured table, into a table cdcd does
   not capture, then into the captured table with
   ``synchronous_standby_names`` empty again. The latency is the client's,
   from sending the INSERT to its return (each commit is its own
   transaction); p50/p99/max after a warm-up, and the p99 added over the
   asynchronous run. The setting is restored to what it was.

PostgreSQL and the broker are throwaway ones unless ``--dsn`` /
``--bootstrap-servers`` are given (the workload then lives in schema
``cdcd_bench`` of that database, which is dropped and recreated, as are the
benchmark's slots and publication).
"""

from __future__ import annotations

import argparse

from cdcd.tools.bench.arguments import add_arguments

__all__ = ["add_arguments", "cmd_bench"]


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark (imported here: building the CLI's parser must stay light)."""
    from cdcd.tools.bench.report import cmd_bench as run

    return run(args)
