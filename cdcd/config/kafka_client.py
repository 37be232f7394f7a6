"""Which of ``kafka.producer``'s properties say how to reach and authenticate to the broker.

Every Kafka client cdcd makes besides the producer -- the admin client of
topic creation and ``cdcd check``, the consumers of ``cdcd.spark`` and of the
``_schemas`` reader -- must connect exactly as the producer does (TLS, SASL,
socket settings) but must not get its tuning (``linger.ms``, ``acks``...),
which other client types reject. Here, below the producer and the consumers,
so both ask the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cdcd.config.secrets import reveal

__all__ = ["admin_config", "connection_properties"]

# Prefixes of librdkafka properties that concern connecting and authenticating,
# which every client needs as much as the producer.
_CONNECTION_PREFIXES = (
    "security.",
    "ssl.",
    "ssl_",
    "sasl.",
    "enable.ssl.",
    "enable.sasl.",
    "https.",
    "socket.",
    "client.",
    "broker.",
    "reconnect.",
    "connections.max.idle.ms",
    "api.version",
    "metadata.",
    "topic.metadata.",
    "retry.backoff",
    "debug",
    "log_level",
    "log.",
    "allow.auto.create.topics",
)


def connection_properties(producer_props: Mapping[str, Any] | None) -> dict[str, Any]:
    """The connection and security properties among ``producer_props``, secrets revealed."""
    return {
        key: value for key, value in reveal(producer_props).items() if key.startswith(_CONNECTION_PREFIXES)
    }


def admin_config(
    bootstrap_servers: str, producer_props: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Client configuration: the broker list plus the producer's connection/security properties."""
    config = connection_properties(producer_props)
    config["bootstrap.servers"] = bootstrap_servers
    return config
