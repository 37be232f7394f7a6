"""``cdcd check``'s presentation: one line per finding, and the exit code.

The findings are the daemon's startup plan run dry (``cdcd.check``); this
module only prints them: ``ok  `` or ``FAIL``, then the line. The exit code
is 2 when a failure is one of configuration (``run`` exits 2 on it too), 1
for any other failure, 0 when all is well.
"""

from __future__ import annotations

import argparse
import logging

from cdcd.config.model import load_config
from cdcd.errors import ConfigError

__all__ = ["cmd_check"]


class _KafkaLines(logging.Handler):
    """The Kafka client's distinct error lines, kept for ``check``'s kafka line instead of printed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # "FAIL [rdkafka#producer-1] [thrd:…]: what happened": only what happened.
        text = record.getMessage().rpartition("]: ")[2].split(" (repeated ")[0]
        if text not in self.lines:
            self.lines.append(text)


def cmd_check(args: argparse.Namespace) -> int:
    from cdcd.check import run_checks

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"FAIL config: {exc}")
        return ConfigError.exit_code
    # One line per check: librdkafka's own lines (one per reconnect attempt) would
    # interleave with them; the first is added to the kafka line. --debug shows all.
    kafka_lines = _KafkaLines()
    if not getattr(args, "debug", False):
        kafka_log = logging.getLogger("cdcd.kafka")
        kafka_log.addHandler(kafka_lines)
        kafka_log.propagate = False
    print(f"ok   config: {args.config}")
    failed = config_failed = 0
    for result in run_checks(config):
        line = result.line
        if not result.ok and line.startswith("kafka:") and kafka_lines.lines:
            line += f" (librdkafka: {kafka_lines.lines[0]})"
        print(f"{'ok  ' if result.ok else 'FAIL'} {line}", flush=True)
        failed += not result.ok
        config_failed += not result.ok and result.config
    # A configuration mistake exits 2, as `run` would on it; other failures 1.
    if config_failed:
        return ConfigError.exit_code
    return 1 if failed else 0
