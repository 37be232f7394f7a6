"""The configuration models (SPEC §3).

``${VAR}`` and ``${VAR:-default}`` in string values are replaced from the
environment after parsing (never inside comments), so secrets stay out of the
file. Validation errors
are turned into one ``ConfigError`` line naming the field (exit code 2).
Secrets (the DSN password, SASL passwords, registry credentials) are masked by
``redacted()`` wherever configuration is printed or logged.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cdcd.errors import ConfigError

_TABLE = re.compile(r'^("?[^".]+"?)\.("?[^".]+"?)$')
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SECRET_KEYS = ("password", "secret", "token", "key.password", "sasl.oauthbearer.config")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableConfig(_Model):
    """One ``postgres.tables`` entry written as a mapping instead of a plain name."""

    name: str = Field(description="schema.table")
    replica_identity: Literal["full"] | None = Field(
        None,
        description="full: cdcd sets REPLICA IDENTITY FULL on a table that has no primary key "
        "or identity index (an explicit opt-in; otherwise such a table is refused)",
    )


class PostgresConfig(_Model):
    dsn: str = Field(description="libpq connection string of the primary (keyword or URI form)")
    slot: str = Field("cdcd", pattern=r"^[a-z0-9_]{1,63}$", description="logical replication slot")
    create_slot: bool = Field(True, description="create the slot if it does not exist")
    publication: str = Field("cdcd", min_length=1, max_length=63, description="publication name")
    create_publication: bool = Field(True, description="create the publication if missing")
    tables: list[str | TableConfig] | None = Field(
        None,
        description="schema.table names (or {name: ..., replica_identity: full} entries) to "
        "capture; omitted: every table of the publication",
    )
    status_interval_s: float = Field(
        10.0, gt=0, description="standby status interval; must be below wal_sender_timeout/2"
    )
    protocol_version: int = Field(1, ge=1, le=4, description="pgoutput protocol version 1..4")
    binary: bool = Field(False, description="ask pgoutput for binary column values")
    connect_timeout_s: float = Field(10.0, gt=0, description="connection timeout")
    stream_spill_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="streamed (v2) transactions bigger than this spill to a local file",
    )
    spill_dir: str | None = Field(None, description="directory for spill files; default: temp dir")

    @field_validator("tables")
    @classmethod
    def _check_tables(
        cls, tables: list[str | TableConfig] | None
    ) -> list[str | TableConfig] | None:
        if tables is None:
            return None
        names = [entry if isinstance(entry, str) else entry.name for entry in tables]
        for name in names:
            if not _TABLE.match(name):
                raise ValueError(f"{name!r} is not schema.table")
        if len(set(names)) != len(names):
            raise ValueError("tables are listed twice")
        return tables

    @property
    def table_names(self) -> list[str] | None:
        """The configured ``schema.table`` names in order; None: every table of the publication."""
        if self.tables is None:
            return None
        return [entry if isinstance(entry, str) else entry.name for entry in self.tables]

    def table_config(self, name: str) -> TableConfig:
        """The per-table settings of ``name`` (defaults for a plain string entry)."""
        for entry in self.tables or ():
            if isinstance(entry, TableConfig) and entry.name == name:
                return entry
        return TableConfig(name=name)


class KafkaConfig(_Model):
    bootstrap_servers: str = Field(description="broker list host:port[,host:port]")
    topic_prefix: str = Field(
        "pg", pattern=r"^[A-Za-z0-9._-]{1,200}$", description="topic per table: <prefix>.<schema>.<table>"
    )
    partitions: int = Field(6, ge=1, description="partitions of topics cdcd creates")
    replication_factor: int = Field(1, ge=1, description="replication factor of topics cdcd creates")
    create_topics: bool = Field(True, description="create missing topics")
    transaction_records: bool = Field(
        False, description="publish BEGIN/END records per transaction to <prefix>.transaction"
    )
    producer: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="librdkafka producer properties, passed through"
    )

    @field_validator("producer")
    @classmethod
    def _check_producer(
        cls, props: dict[str, str | int | float | bool]
    ) -> dict[str, str | int | float | bool]:
        fixed = {"enable.idempotence", "acks", "bootstrap.servers"}
        clash = sorted(fixed & props.keys())
        if clash:
            raise ValueError(
                f"{', '.join(clash)} cannot be overridden: cdcd requires idempotence and acks=all"
            )
        return props


class SchemaRegistryConfig(_Model):
    url: str | None = Field(
        None, description="Confluent Schema Registry URL; null: Avro single-object encoding"
    )
    config: dict[str, str] = Field(
        default_factory=dict, description="extra SchemaRegistryClient settings (basic.auth...)"
    )


class SnapshotConfig(_Model):
    mode: Literal["initial", "never", "initial_only"] = Field(
        "initial", description="initial | never | initial_only"
    )
    chunk_rows: int = Field(10_000, ge=1, description="rows per snapshot chunk")
    parallelism: int = Field(2, ge=1, le=32, description="connections reading the snapshot")
    signal_table: str = Field("cdcd_signal", description="table polled for incremental snapshots")


class MetricsConfig(_Model):
    listen: str = Field(
        "0.0.0.0:9187", pattern=r"^.+:\d{1,5}$", description="host:port for /metrics, /healthz, /readyz"
    )
    log_format: Literal["text", "json"] = Field("text", description="text or json log lines")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    lag_sample_interval_s: float = Field(
        5.0,
        gt=0,
        le=300,
        description="how often cdcd_slot_lag_bytes is measured (one query on the source)",
    )


class HeartbeatConfig(_Model):
    interval_s: float = Field(
        30.0, ge=0, description="pg_logical_emit_message heartbeat interval; 0 disables"
    )


class CdcdConfig(_Model):
    postgres: PostgresConfig
    kafka: KafkaConfig
    schema_registry: SchemaRegistryConfig = Field(default_factory=lambda: SchemaRegistryConfig())
    snapshot: SnapshotConfig = Field(default_factory=lambda: SnapshotConfig())
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig())
    heartbeat: HeartbeatConfig = Field(default_factory=lambda: HeartbeatConfig())

    def redacted(self) -> dict[str, Any]:
        """The configuration as a dict with every secret masked."""
        data = self.model_dump()
        data["postgres"]["dsn"] = redact_dsn(self.postgres.dsn)
        for key in data["kafka"]["producer"]:
            if any(word in key for word in _SECRET_KEYS):
                data["kafka"]["producer"][key] = "***"
        for key in data["schema_registry"]["config"]:
            if any(word in key for word in ("password", "secret", "token", "user.info")):
                data["schema_registry"]["config"][key] = "***"
        if data["schema_registry"]["url"]:
            data["schema_registry"]["url"] = re.sub(
                r"//[^/@]*@", "//***@", data["schema_registry"]["url"]
            )
        return data


def redact_dsn(dsn: str) -> str:
    """Mask the password in a keyword or URI libpq connection string."""
    dsn = re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)
    return re.sub(r"(postgres(?:ql)?://[^:/@]*:)[^@]*@", r"\1***@", dsn)


def expand_env(text: str) -> str:
    """Replace ``${VAR}`` / ``${VAR:-default}``; a missing variable without default is an error."""

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is None:
            if default is None:
                raise ConfigError(
                    f"environment variable {name} is not set",
                    hint=f"export {name} or write ${{{name}:-default}} in the file",
                )
            return default
        return value

    return _ENV.sub(replace, text)


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def parse_config(data: Any, source: str = "configuration") -> CdcdConfig:
    """Validate already-loaded YAML data."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return CdcdConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = _field_path(first["loc"])
        if first["type"] == "extra_forbidden":
            message = f"{source}: unknown key '{field}'"
        elif first["type"] == "missing":
            message = f"{source}: '{field}' is required"
        else:
            message = f"{source}: '{field}': {first['msg']}"
        more = len(exc.errors()) - 1
        if more:
            message += f" (and {more} more error{'s' if more > 1 else ''})"
        raise ConfigError(message) from exc


def load_config(path: str | Path) -> CdcdConfig:
    """Read, expand and validate a configuration file; raises ``ConfigError``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}".replace("\n", " ")) from exc
    # Expanded after parsing, in string values only: comments are never
    # expanded, and a value cannot inject YAML structure.
    return parse_config(_expand_values(data), str(path))


def _expand_values(data: Any) -> Any:
    if isinstance(data, str):
        return expand_env(data)
    if isinstance(data, dict):
        return {key: _expand_values(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_expand_values(value) for value in data]
    return data
