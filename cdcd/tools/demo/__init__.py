"""``cdcd demo``: the whole pipeline on one machine, for a newcomer's first five minutes.

Why it exists: the quickest way to understand cdcd is to watch a row change in
PostgreSQL come out of Kafka as a decoded envelope. The demo needs nothing but
this package and PostgreSQL 15 installed: it starts a throwaway cluster
(:class:`cdcd.tools.local.LocalPostgres`) and the bundled Kafka-compatible broker
(:class:`cdcd.tools.local.LocalBroker`), creates two sample tables, writes a steady
trickle of changes from a background thread and runs the *real* daemon
(:class:`cdcd.daemon.Daemon`) in-process, with nothing mocked.

What it prints comes from Kafka, not from the daemon: a plain confluent-kafka
consumer reads the topics and decodes every envelope with plain fastavro and
the writer schemas of ``<prefix>._schemas`` (read by :mod:`cdcd.consumer`,
as ``cdcd.spark`` reads them), exactly as any consumer would.
So what scrolls by is proof that the messages are readable by third parties.
Messages are shown in (``cdcd.lsn``, ``cdcd.seq``) order, the order consumers
de-duplicate and apply on; a short hold time reorders what arrives from
different partitions.

Every few seconds a status line shows the daemon's own figures (events/s,
confirmed LSN, slot lag, commit-to-Kafka latency) read from its ``Metrics``
object, the same numbers ``/metrics`` serves.

Ctrl-C or SIGTERM stops the writer, lets the consumer catch up, stops the
daemon (which drains and confirms, as ``cdcd run`` does), then stops the
broker and PostgreSQL and removes their directories. A second Ctrl-C skips
the waiting; a third one aborts (the at-exit handlers of ``cdcd.tools.local`` still
remove the throwaway servers). ``--duration S`` stops by itself after S
seconds of streaming, for scripts and CI.
"""

from cdcd.tools.demo.run import cmd_demo

__all__ = ["cmd_demo"]
