"""Credentials in ``postgres.dsn``, ``kafka.producer`` and ``schema_registry.config`` are ``SecretStr``.

No repr of the configuration (a log line, a traceback, a debugger) shows them;
the clients still get the plain value: librdkafka's configuration and the
registry client's settings are built from the revealed properties.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg2.extensions
import pytest
from pydantic import SecretStr

from cdcd.config.kafka_client import admin_config
from cdcd.config.model import load_config, parse_config
from cdcd.envelope import wire
from cdcd.sink.producer import build_producer_config

SASL = "sasl-Zebra7 'q'"
USER_INFO = "reg-user:reg-Pass9"
DSN_PASSWORD = "pg-Orca5 'x'"


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


def test_no_repr_of_the_configuration_shows_the_dsn_password(tmp_path: Path) -> None:
    """``postgres.dsn`` is a ``SecretStr``: a loaded configuration prints none of its password."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "postgres: {dsn: 'host=db user=cdc password=${CDCD_DSN_SECRET}'}\n"
        "kafka: {bootstrap_servers: k}\n",
        encoding="utf-8",
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CDCD_DSN_SECRET", DSN_PASSWORD)
        config = load_config(path)
    for shown in (config, config.postgres):
        for text in (repr(shown), str(shown)):
            assert DSN_PASSWORD not in text and "Orca" not in text, text
    assert isinstance(config.postgres.dsn, SecretStr)
    # The client gets it only when it asks for the text, quoted the libpq way.
    revealed = config.postgres.dsn.get_secret_value()
    assert psycopg2.extensions.parse_dsn(revealed)["password"] == DSN_PASSWORD
    assert config.redacted()["postgres"]["dsn"] == "host=db user=cdc password=***"
