"""Secrets of the configuration: held as pydantic ``SecretStr``, revealed only for a client.

A ``SecretStr`` prints as ``**********`` in a repr, a log line or a traceback
of the configuration, so a password set in ``kafka.producer`` or
``schema_registry.config`` cannot leak through them. The plain value is
taken out (:func:`reveal`) only where the properties are handed to
librdkafka or the registry client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import SecretStr

__all__ = ["PRODUCER_SECRET_KEYS", "REGISTRY_SECRET_KEYS", "conceal", "is_secret_key", "reveal"]

#: librdkafka producer properties that hold secrets (passwords, client
#: secrets, OAuth config, an inline private key): words in the property name.
PRODUCER_SECRET_KEYS = (
    "password", "secret", "token", "sasl.oauthbearer.config", "ssl.key.pem", "ssl_key",
)  # fmt: skip
#: SchemaRegistryClient settings that hold secrets ("user:password" in basic.auth.user.info).
REGISTRY_SECRET_KEYS = ("password", "secret", "token", "user.info", "ssl.key.pem")

_V = TypeVar("_V")


def is_secret_key(key: str, words: tuple[str, ...]) -> bool:
    """Whether property ``key`` holds a secret: its name contains one of ``words``."""
    lowered = key.lower()
    return any(word in lowered for word in words)


def conceal(props: Mapping[str, _V], words: tuple[str, ...]) -> dict[str, _V | SecretStr]:
    """``props`` with every text value of a secret property wrapped in ``SecretStr``."""
    return {
        key: SecretStr(value) if isinstance(value, str) and is_secret_key(key, words) else value
        for key, value in props.items()
    }


def reveal(props: Mapping[str, Any] | None) -> dict[str, Any]:
    """``props`` with every ``SecretStr`` replaced by its value, for a client library."""
    return {
        key: value.get_secret_value() if isinstance(value, SecretStr) else value
        for key, value in (props or {}).items()
    }
