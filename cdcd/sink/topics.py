"""Topic names, topic creation and the broker reachability check.

cdcd creates the topics it writes to before the first message (when
``kafka.create_topics`` is true) rather than relying on the broker's
auto-creation: auto-created topics get the broker's default partition count and
no compaction, and ``<prefix>._schemas`` must be compacted (SPEC §6) so that
every writer schema stays readable forever. :func:`cdcd.naming.topic_spec`
says how each topic is created.

Creation is idempotent and tolerant of concurrent creators (a second cdcd, or
a restart racing a slow controller): ``TOPIC_ALREADY_EXISTS`` counts as
success. Existing topics are checked, not changed: a different partition count
or configuration is logged as a warning, because repartitioning a CDC topic
would break per-key order for its consumers and is the operator's decision.

The admin client gets the user's connection and security properties (TLS,
SASL) from ``kafka.producer``, filtered to those an admin client needs, so that
``cdcd check`` and topic creation authenticate like the producer does.

Topic names and the rule for each topic's shape are in :mod:`cdcd.naming`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # stubs omit the re-exports
    AdminClient,
    ClusterMetadata,
    ConfigResource,
    NewTopic,
)

from cdcd import naming
from cdcd.config.kafka_client import admin_config
from cdcd.config.model import KafkaConfig
from cdcd.errors import CdcdError, ConfigError, DefiniteError, TransientError
from cdcd.naming import TopicSpec
from cdcd.sink.reporter import AUTH_CODES, KAFKA_REPORTER, KafkaLogReporter

__all__ = [
    "TopicSpec",
    "admin_config",
    "check_broker",
    "ensure_topics",
    "topic_spec",
]

log = logging.getLogger(__name__)


def topic_spec(kafka: KafkaConfig, name: str) -> TopicSpec:
    """How cdcd creates topic ``name`` under ``kafka``'s settings (the rule: :func:`cdcd.naming.topic_spec`)."""
    return naming.topic_spec(
        kafka.topic_prefix,
        name,
        table_partitions=kafka.partitions,
        replication_factor=kafka.replication_factor,
    )


# --------------------------------------------------------------------- admin

#: How long one metadata request of cdcd's own admin client may wait before
#: cdcd looks at its error callbacks (see ``_Admin.metadata``).
_METADATA_SLICE_S = 0.25


class _Admin:
    """An AdminClient plus what error messages need: where it points, what went wrong.

    An admin client cdcd creates logs through ``reporter`` (once per distinct
    error, with repeat counts). It delivers its log and error callbacks only
    when polled: :meth:`metadata_error` and :meth:`answered` poll it.
    """

    def __init__(
        self,
        target: AdminClient | str,
        producer_props: Mapping[str, Any] | None,
        reporter: KafkaLogReporter | None = None,
    ) -> None:
        self.errors: deque[KafkaError] = deque(maxlen=16)  # from error_cb, own clients only
        self.down_reports = 0  # error_cb's "all brokers down", own clients only
        self.owned = isinstance(target, str)
        self.reporter = reporter if reporter is not None else KAFKA_REPORTER
        if isinstance(target, str):
            self.bootstrap_servers = target
            self.where = f"Kafka at {target}"
            config = admin_config(target, producer_props)
            config["error_cb"] = self._on_error
            config["logger"] = self.reporter
            try:
                self.client = AdminClient(config)
            except KafkaException as exc:
                detail = (
                    exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else exc
                )
                raise ConfigError(
                    f"kafka.producer: {detail}",
                    hint="fix the connection/security properties (ssl.*, sasl.*) in kafka.producer",
                ) from exc
        else:
            self.bootstrap_servers = ""
            self.where = "Kafka"
            self.client = target

    def _on_error(self, err: KafkaError) -> None:
        self.errors.append(err)
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.down_reports += 1
        self.reporter.kafka_error(err, fatal_what="Kafka admin client")

    def metadata(self, timeout_s: float) -> ClusterMetadata:
        """The cluster's metadata (brokers, topics); raises what :meth:`metadata_error` makes.

        librdkafka waits the whole timeout for an answer even when every
        bootstrap server refuses the connection at once. A client of cdcd's
        own asks in slices and, between them, serves its error callback:
        once every broker is down and a slice found no answer, the failure
        is reported at once (an unanswered connection attempt still takes the
        whole timeout, or librdkafka's connection timeout).
        """
        deadline = time.monotonic() + timeout_s
        down_before = self.down_reports
        while True:
            remaining = deadline - time.monotonic()
            ask = min(remaining, _METADATA_SLICE_S) if self.owned else remaining
            asked = time.monotonic()
            try:
                metadata = self.client.list_topics(timeout=max(ask, 0.001))
            except KafkaException as exc:
                if remaining > ask and not self._all_brokers_down(since=down_before):
                    if time.monotonic() - asked < _METADATA_SLICE_S / 10:
                        # An error that came back at once: ask again a slice later, not in a spin.
                        time.sleep(min(_METADATA_SLICE_S, max(0.0, deadline - time.monotonic())))
                    continue
                raise self.metadata_error(exc, timeout_s, given_up=remaining > ask) from exc
            self.answered()
            return metadata

    def _all_brokers_down(self, since: int) -> bool:
        """An error callback served since report ``since`` said no broker is up (own clients)."""
        if not self.owned:
            return False
        self.client.poll(0)
        return self.down_reports > since

    def answered(self) -> None:
        """A request succeeded: report what the client logged, then that Kafka is reachable."""
        if self.owned:
            self.client.poll(0)
            self.reporter.reachable(self.bootstrap_servers)

    def metadata_error(
        self, exc: KafkaException, timeout_s: float, given_up: bool = False
    ) -> CdcdError:
        """A failed metadata request: authentication problems are definite, the rest transient.

        ``given_up``: stopped before ``timeout_s`` because every broker was down.
        """
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if self.owned:
            # error_cb and the logger run only when the client is polled; the
            # authentication failure behind a metadata timeout is reported there.
            self.client.poll(0)
        for seen in [*self.errors, *([err] if err is not None else [])]:
            if seen.code() in AUTH_CODES:
                return DefiniteError(
                    f"cannot authenticate to {self.where}: {seen.str()}",
                    hint="check security.protocol and the ssl.*/sasl.* properties in kafka.producer",
                )
        detail = err.str() if err is not None else str(exc)
        if given_up:
            refused = [seen.str() for seen in self.errors if seen.code() != KafkaError._ALL_BROKERS_DOWN]
            return TransientError(
                f"cannot reach {self.where}: every broker is down"
                + (f" ({refused[-1]})" if refused else f" ({detail})")
            )
        return TransientError(f"cannot reach {self.where} within {timeout_s:g} s: {detail}")


def check_broker(
    bootstrap_servers: str,
    producer_props: Mapping[str, Any] | None,
    timeout_s: float,
    *,
    reporter: KafkaLogReporter | None = None,
) -> str:
    """One metadata round trip; a short description of the cluster, for ``cdcd check``.

    Raises :class:`TransientError` naming the bootstrap servers when no broker
    answers, :class:`DefiniteError` when authentication fails. librdkafka's
    messages go to ``reporter`` (default: the process's).
    """
    admin = _Admin(bootstrap_servers, producer_props, reporter)
    metadata = admin.metadata(timeout_s)
    ids = sorted(metadata.brokers)
    plural = "" if len(ids) == 1 else "s"
    return (
        f"{len(ids)} broker{plural} (id{plural} {', '.join(map(str, ids))}), "
        f"controller {metadata.controller_id}, cluster {metadata.cluster_id}"
    )


def ensure_topics(
    admin_or_bootstrap: AdminClient | str,
    specs: Iterable[TopicSpec],
    timeout_s: float,
    *,
    producer_props: Mapping[str, Any] | None = None,
    reporter: KafkaLogReporter | None = None,
) -> list[str]:
    """Create the missing topics of ``specs`` and check the existing ones; returns those created.

    ``admin_or_bootstrap`` is an AdminClient or a bootstrap server list (then
    ``producer_props`` supplies the security properties). Tolerates
    ``TOPIC_ALREADY_EXISTS``. Raises :class:`TransientError` when the broker
    cannot be reached, :class:`DefiniteError` (with a hint) when a topic
    cannot be created as specified: no permission, invalid configuration or
    name, replication factor above the number of brokers. librdkafka's
    messages go to ``reporter`` (default: the process's).
    """
    admin = _Admin(admin_or_bootstrap, producer_props, reporter)
    wanted = {spec.name: spec for spec in specs}
    if not wanted:
        return []
    metadata = admin.metadata(timeout_s)
    brokers = len(metadata.brokers)

    existing = [spec for name, spec in wanted.items() if name in metadata.topics]
    for spec in existing:
        topic = metadata.topics[spec.name]
        if topic.error is not None and topic.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise _topic_error(topic.error, spec, brokers)
        count = len(topic.partitions)
        if count != spec.partitions:
            log.warning(
                "topic %s has %d partitions, cdcd would create it with %d; using it as it is",
                spec.name,
                count,
                spec.partitions,
            )
    _check_configs(admin, [spec for spec in existing if spec.config], timeout_s)

    missing = [spec for name, spec in wanted.items() if name not in metadata.topics]
    if not missing:
        return []
    for spec in missing:
        if spec.replication_factor > brokers:
            raise DefiniteError(
                f"cannot create topic {spec.name!r} with replication factor "
                f"{spec.replication_factor}: {admin.where} has {brokers} broker"
                f"{'' if brokers == 1 else 's'} available",
                hint=f"set kafka.replication_factor to at most {brokers}, "
                "or start the missing brokers",
            )
    new_topics = [
        NewTopic(
            spec.name,
            num_partitions=spec.partitions,
            replication_factor=spec.replication_factor,
            config=dict(spec.config),
        )
        for spec in missing
    ]
    try:
        futures = admin.client.create_topics(
            new_topics, operation_timeout=timeout_s, request_timeout=timeout_s
        )
    except KafkaException as exc:
        raise admin.metadata_error(exc, timeout_s) from exc

    created: list[str] = []
    failures: list[CdcdError] = []
    for name, future in futures.items():
        spec = wanted[name]
        try:
            future.result()
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if err is not None and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                log.info("topic %s was created concurrently", name)
                continue
            failures.append(
                _topic_error(err, spec, brokers)
                if err is not None
                else TransientError(f"creating topic {name!r} failed: {exc}")
            )
            continue
        log.info(
            "created topic %s (%d partitions, replication factor %d%s)",
            name,
            spec.partitions,
            spec.replication_factor,
            "".join(f", {k}={v}" for k, v in sorted(spec.config.items())),
        )
        created.append(name)
    if failures:
        # A definite failure wins: retrying the transient ones cannot fix it.
        failures.sort(key=lambda error: not isinstance(error, DefiniteError))
        raise failures[0]
    return created


def _topic_error(err: KafkaError, spec: TopicSpec, brokers: int) -> CdcdError:
    """Classify a CreateTopics (or metadata) error for one topic."""
    code = err.code()
    what = f"cannot create topic {spec.name!r}: {err.name()} ({err.str()})"
    if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED):
        return DefiniteError(
            what,
            hint="grant CREATE (and DESCRIBE, WRITE) on the topics to the principal cdcd "
            "connects as, or create the topics yourself and set kafka.create_topics: false",
        )
    if code == KafkaError.INVALID_REPLICATION_FACTOR:
        return DefiniteError(
            what,
            hint=f"set kafka.replication_factor to at most the number of brokers ({brokers})",
        )
    if code == KafkaError.INVALID_PARTITIONS:
        return DefiniteError(what, hint="set kafka.partitions to a positive number")
    if code == KafkaError.INVALID_CONFIG:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(spec.config.items())) or "none"
        return DefiniteError(
            what,
            hint=f"the broker rejects the topic configuration ({settings}) or the partition "
            "count/replication factor; check the broker's limits",
        )
    if code == KafkaError.TOPIC_EXCEPTION:
        return DefiniteError(what, hint="change kafka.topic_prefix to a valid topic name prefix")
    if code == KafkaError.POLICY_VIOLATION:
        return DefiniteError(
            what,
            hint="a broker create-topic policy rejects it; create the topic yourself "
            "and set kafka.create_topics: false",
        )
    if code in AUTH_CODES:
        return DefiniteError(
            what, hint="check security.protocol and the ssl.*/sasl.* properties in kafka.producer"
        )
    return TransientError(what)


def _check_configs(admin: _Admin, specs: list[TopicSpec], timeout_s: float) -> None:
    """Warn when an existing topic's configuration differs from the spec (never fails).

    Kafka describes every setting; some brokers (tansu) describe only the
    settings given at creation, so a setting missing from the answer is not
    reported as a difference.
    """
    if not specs:
        return
    resources = {ConfigResource("topic", spec.name): spec for spec in specs}
    try:
        futures = admin.client.describe_configs(list(resources), request_timeout=timeout_s)
    except KafkaException as exc:
        log.warning("cannot describe topic configurations: %s", exc)
        return
    for resource, future in futures.items():
        spec = resources[resource]
        try:
            entries = future.result()
        except KafkaException as exc:
            log.warning("cannot describe the configuration of topic %s: %s", spec.name, exc)
            continue
        for key, expected in spec.config.items():
            entry = entries.get(key)
            if entry is not None and entry.value != expected:
                log.warning(
                    "topic %s has %s=%s, cdcd expects %s=%s; using it as it is",
                    spec.name,
                    key,
                    entry.value,
                    key,
                    expected,
                )
