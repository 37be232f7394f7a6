"""Credentials in ``kafka.producer`` and ``schema_registry.config`` are pydantic ``SecretStr``.

No repr of the configuration (a log line, a traceback, a debugger) shows them;
the clients still get the plain value: librdkafka's configuration and the
registry client's settings are built from the revealed properties.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import SecretStr

from cdcd.config.kafka_client import admin_config
from cdcd.config.model import parse_config
from cdcd.envelope import wire
from cdcd.sink.producer import build_producer_config

SASL = "sasl-Zebra7 'q'"
USER_INFO = "reg-user:reg-Pass9"


def _config() -> Any:
    return parse_config(
        {
            "postgres": {"dsn": "host=db"},
            "kafka": {
                "bootstrap_servers": "k:9092",
                "producer": {
                    "sasl.password": SASL,
                    "sasl.username": "cdc",
                    "linger.ms": 5,
                },
            },
            "schema_registry": {
                "url": "http://registry:8081",
                "config": {"basic.auth.user.info": USER_INFO, "timeout": "7"},
            },
        }
    )


def test_no_repr_of_the_configuration_shows_a_credential() -> None:
    config = _config()
    for text in (repr(config), str(config), repr(config.kafka), repr(config.schema_registry)):
        assert SASL not in text and USER_INFO not in text and "reg-Pass9" not in text
    assert isinstance(config.kafka.producer["sasl.password"], SecretStr)
    assert isinstance(config.schema_registry.config["basic.auth.user.info"], SecretStr)
    # What is not a secret stays as written.
    assert config.kafka.producer["sasl.username"] == "cdc"
    assert config.kafka.producer["linger.ms"] == 5
    assert config.schema_registry.config["timeout"] == "7"
    # A configuration rebuilt from its own dump keeps them secret.
    again = parse_config(config.model_dump())
    assert again == config and SASL not in repr(again)


def test_the_clients_get_the_plain_values() -> None:
    config = _config()
    producer = build_producer_config("k:9092", dict(config.kafka.producer), "cdcd")
    assert producer["sasl.password"] == SASL and producer["linger.ms"] == 5
    admin = admin_config("k:9092", config.kafka.producer)
    assert admin["sasl.password"] == SASL and "linger.ms" not in admin


def test_the_registry_client_gets_the_plain_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import schema_registry

    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        schema_registry.SchemaRegistryClient, "new_client", staticmethod(lambda conf: seen.update(conf))
    )
    config = _config()
    wire.registry_client("http://registry:8081", config.schema_registry.config)
    assert seen["basic.auth.user.info"] == USER_INFO and seen["timeout"] == 7
