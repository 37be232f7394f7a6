"""The configuration models (SPEC §3).

``${VAR}`` and ``${VAR:-default}`` in string values are replaced from the
environment after parsing (never inside comments), so secrets stay out of the
file. In ``postgres.dsn`` the value is quoted the libpq way (single-quoted
keyword values, percent-encoded URI parts: ``cdcd.config.dsn``), so a password
with spaces or quotes reads back exactly. Validation errors are turned into one
``ConfigError`` line naming the field, an unknown key first with the nearest
known key (exit code 2). Secrets (the DSN password, SASL/SSL passwords and
keys, registry credentials) are masked by ``redacted()`` wherever
configuration is printed or logged. ``postgres.dsn`` and the secrets of
``kafka.producer`` and ``schema_registry.config`` are held as ``SecretStr``
besides (:mod:`cdcd.config.secrets`), so no repr of the configuration shows
them: a client takes the text out explicitly (``dsn.get_secret_value()``).
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    ValidationError,
    field_validator,
)

# redact_dsn is re-exported: check and the source connection import it from here.
from cdcd.config.dsn import redact_dsn as redact_dsn
from cdcd.config.dsn import substitute_dsn
from cdcd.config.secrets import PRODUCER_SECRET_KEYS, REGISTRY_SECRET_KEYS, conceal, is_secret_key
from cdcd.errors import ConfigError
from cdcd.naming import (
    matches_table,
    parse_table,
    table_globs,
    table_topic,
    table_topic_pattern,
    topic_glob_regex,
)

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

#: A ``kafka.producer`` value; secret ones are held as ``SecretStr`` (cdcd.config.secrets).
ProducerValue = str | int | float | bool | SecretStr


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableConfig(_Model):
    """One ``postgres.tables`` entry written as a mapping instead of a plain name."""

    name: str = Field(
        description="schema.table, or a pattern whose unquoted parts may hold * and ? "
        "(public.*), expanded against the catalog at startup"
    )
    where: str | None = Field(
        None,
        min_length=1,
        description="PostgreSQL 15+: row filter, a SQL boolean expression over the table's "
        "columns (the publication's WHERE); with UPDATE/DELETE published it may only use "
        "replica identity columns. A row that stops matching is a delete downstream, one "
        "that starts matching a create; snapshots apply the same filter",
    )
    columns: list[str] | None = Field(
        None,
        min_length=1,
        description="PostgreSQL 15+: column list, the only columns published (and in the Avro "
        "schemas and snapshots); must include every replica identity column",
    )
    topic: str | None = Field(
        None,
        min_length=1,
        max_length=249,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Kafka topic of this table instead of <prefix>.<schema>.<table> "
        "(not on a pattern)",
    )
    replica_identity: Literal["full"] | None = Field(
        None,
        description="full: cdcd sets REPLICA IDENTITY FULL on a table that has no primary key "
        "or identity index (an explicit opt-in; otherwise such a table is refused)",
    )
    history: bool = Field(
        False,
        description="cdcd mirror: also keep the table's history table (every version of "
        "every row, SCD type 2), as --history does for every table",
    )
    history_columns: list[str] | None = Field(
        None,
        min_length=1,
        description="cdcd mirror history: only changes to these columns start a new version "
        "(AutoCDC's track_history_column_list); a change to other columns only updates the "
        "current version. Default: every column",
    )

    @field_validator("columns")
    @classmethod
    def _check_columns(cls, columns: list[str] | None) -> list[str] | None:
        if columns is not None and len(set(columns)) != len(columns):
            raise ValueError("a column is listed twice")
        return columns

    @property
    def globs(self) -> tuple[str, str] | None:
        """The pattern's globs; None when ``name`` names one table."""
        return table_globs(self.name)


def _entry_kind(value: Any) -> str:
    return "TableConfig" if isinstance(value, dict | TableConfig) else "str"


#: One ``postgres.tables`` entry; the discriminator keeps a mapping's error
#: from being reported as "should be a valid string".
TableEntry = Annotated[
    Annotated[str, Tag("str")] | Annotated[TableConfig, Tag("TableConfig")],
    Discriminator(_entry_kind),
]


class PostgresConfig(_Model):
    dsn: SecretStr = Field(
        description="libpq connection string of the primary (keyword or URI form); a ${VAR} in "
        "a value is quoted (keyword form) or percent-encoded (URI) so any password reads back "
        "exactly, e.g. password=${PGPASSWORD}"
    )
    slot: str = Field("cdcd", pattern=r"^[a-z0-9_]{1,63}$", description="logical replication slot")
    create_slot: bool = Field(True, description="create the slot if it does not exist")
    publication: str = Field("cdcd", min_length=1, max_length=63, description="publication name")
    create_publication: bool = Field(True, description="create the publication if missing")
    tables: list[TableEntry] | None = Field(
        None,
        description="schema.table names or patterns (public.*), or {name, where, columns, "
        "topic, replica_identity} entries, to capture; omitted: every table of the publication",
    )
    publish_via_partition_root: bool = Field(
        True,
        description="a partitioned table's changes (and snapshot) go to the root table's topic; "
        "false: each leaf partition has its own topic",
    )
    origin: Literal["any", "none"] = Field(
        "any",
        description="PostgreSQL 16+: none skips changes that came from replication (another "
        "node's subscription), so bidirectional setups do not loop; refused on older servers",
    )
    publish_generated_columns: bool = Field(
        False,
        description="PostgreSQL 18+: publish stored generated columns (publication option "
        "publish_generated_columns = stored); refused on older servers",
    )
    failover: bool = Field(
        False,
        description="PostgreSQL 17+: make the slot a failover slot, synchronized to standbys "
        "that may be promoted (the dsn then lists them: host=a,b target_session_attrs=read-write; "
        "docs/failover.md); refused on older servers",
    )
    application_name: str | None = Field(
        None,
        pattern=r"^[\x20-\x7e]{1,63}$",
        description="application_name of the replication connection, the name to list in "
        "synchronous_standby_names to make cdcd a synchronous standby (docs/synchronous.md); "
        "null: the slot name",
    )
    status_interval_s: float = Field(
        10.0, gt=0, description="standby status interval; must be below wal_sender_timeout/2"
    )
    protocol_version: int = Field(1, ge=1, le=4, description="pgoutput protocol version 1..4")
    binary: bool = Field(
        False,
        description="removed: only false is accepted (kept so that older files still load); "
        "cdcd always asks pgoutput for text values",
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="connection timeout")
    stream_spill_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="streamed (v2) transactions bigger than this spill to a local file",
    )
    spill_dir: str | None = Field(None, description="directory for spill files; default: temp dir")

    @field_validator("binary")
    @classmethod
    def _check_binary(cls, binary: bool) -> bool:
        if binary:
            # "message; hint", as ConfigError prints it.
            raise ValueError(
                "binary mode was removed; delete the key or set it to false: measured, text "
                "values are as fast on the server and faster in cdcd (docs/performance.md)"
            )
        return binary

    @field_validator("tables")
    @classmethod
    def _check_tables(
        cls, tables: list[str | TableConfig] | None
    ) -> list[str | TableConfig] | None:
        if tables is None:
            return None
        parsed = []
        for entry in tables:
            name = entry if isinstance(entry, str) else entry.name
            qualified = parse_table(name)
            if qualified is None:
                raise ValueError(
                    f"{name!r} is not schema.table (double-quote a name containing "
                    '"." or \'"\'; a " inside quotes is written "")'
                )
            if isinstance(entry, TableConfig) and entry.topic and entry.globs:
                raise ValueError(f"{name!r} is a pattern: topic names one table's topic")
            parsed.append(qualified)
        # Compared as names, not spellings: public.t and "public".t are one table.
        if len(set(parsed)) != len(parsed):
            raise ValueError("tables are listed twice")
        return tables

    @property
    def replication_application_name(self) -> str:
        """``application_name`` of the replication connection: the configured one, or the slot."""
        return self.application_name or self.slot

    @property
    def table_names(self) -> list[str] | None:
        """The configured ``schema.table`` names in order; None: every table of the publication."""
        if self.tables is None:
            return None
        return [entry if isinstance(entry, str) else entry.name for entry in self.tables]

    def table_config(self, name: str) -> TableConfig:
        """The per-table settings of ``name`` (defaults for a plain string entry).

        An entry naming the table itself wins over a pattern that matches it;
        among patterns, the first listed.
        """
        wanted = parse_table(name)
        entries = [e for e in self.tables or () if isinstance(e, TableConfig)]
        for entry in entries:
            if entry.globs is None and (
                entry.name == name or (wanted is not None and parse_table(entry.name) == wanted)
            ):
                return entry
        if wanted is not None and not any(
            isinstance(e, str) and parse_table(e) == wanted for e in self.tables or ()
        ):
            for entry in entries:
                globs = entry.globs
                if globs is not None and matches_table(globs, *wanted):
                    return entry
        return TableConfig(name=name)

    def topic_overrides(self) -> dict[tuple[str, str], str]:
        """(schema, table) -> the ``topic`` its entry names instead of ``<prefix>.<schema>.<table>``."""
        out = {}
        for entry in self.tables or ():
            if isinstance(entry, TableConfig) and entry.topic:
                parsed = parse_table(entry.name)
                assert parsed is not None  # validated; a pattern cannot carry a topic
                out[parsed] = entry.topic
        return out

    @property
    def patterns(self) -> list[str]:
        """The ``postgres.tables`` entries that are patterns, in order."""
        names = [e if isinstance(e, str) else e.name for e in self.tables or ()]
        return [n for n in names if table_globs(n) is not None]


class KafkaConfig(_Model):
    bootstrap_servers: str = Field(description="broker list host:port[,host:port]")
    topic_prefix: str = Field(
        "pg", pattern=r"^[A-Za-z0-9._-]{1,200}$", description="topic per table: <prefix>.<schema>.<table>"
    )
    partitions: int = Field(
        6,
        ge=1,
        description="partitions of each table topic cdcd creates; <prefix>.transaction, "
        "<prefix>.message and <prefix>._schemas always get 1 (one global order)",
    )
    replication_factor: int = Field(1, ge=1, description="replication factor of topics cdcd creates")
    create_topics: bool = Field(True, description="create missing topics")
    transaction_records: bool = Field(
        False, description="publish BEGIN/END records per transaction to <prefix>.transaction"
    )
    producer: dict[str, ProducerValue] = Field(
        default_factory=dict,
        description="librdkafka producer properties, passed through over cdcd's defaults "
        "(listed in docs/operations.md, The Kafka producer); passwords, secrets, "
        "tokens and keys are held as secrets: never shown in a log or repr",
    )

    @field_validator("producer")
    @classmethod
    def _check_producer(cls, props: dict[str, ProducerValue]) -> dict[str, ProducerValue]:
        fixed = {"enable.idempotence", "acks", "bootstrap.servers"}
        clash = sorted(fixed & props.keys())
        if clash:
            raise ValueError(
                f"{', '.join(clash)} cannot be overridden: cdcd requires idempotence and acks=all"
            )
        return conceal(props, PRODUCER_SECRET_KEYS)


class SchemaRegistryConfig(_Model):
    url: str | None = Field(
        None, description="Confluent Schema Registry URL; null: Avro single-object encoding"
    )
    config: dict[str, str | SecretStr] = Field(
        default_factory=dict,
        description="extra SchemaRegistryClient settings (basic.auth...; credentials are held "
        "as secrets: never shown in a log or repr)",
    )

    @field_validator("config")
    @classmethod
    def _conceal_credentials(cls, config: dict[str, str | SecretStr]) -> dict[str, str | SecretStr]:
        return conceal(config, REGISTRY_SECRET_KEYS)


class SnapshotConfig(_Model):
    mode: Literal["initial", "never", "initial_only"] = Field(
        "initial", description="initial | never | initial_only"
    )
    chunk_rows: int = Field(10_000, ge=1, description="rows per snapshot chunk")
    incremental_chunk_rows: int | None = Field(
        None,
        ge=1,
        description="rows per chunk of an incremental snapshot (a heal, cdcd snapshot --table, "
        "the rest of an interrupted initial snapshot); default 3 x chunk_rows: it holds one "
        "chunk at a time where the initial snapshot holds up to 3 x parallelism + 1, and each "
        "chunk costs two watermark transactions, so larger chunks copy faster",
    )
    parallelism: int = Field(2, ge=1, le=32, description="connections reading the snapshot")
    processes: int = Field(
        0,
        ge=0,
        le=32,
        description="0: the initial snapshot is read by threads of the daemon (parallelism "
        "connections); N: by N worker processes, each with its own connection importing the "
        "exported snapshot and its own Kafka producer, for more than one core "
        "(docs/snapshots.md)",
    )
    signal_table: str = Field("cdcd_signal", description="table polled for incremental snapshots")

    @property
    def incremental_rows(self) -> int:
        """Rows per chunk of an incremental snapshot: the setting, or 3 x ``chunk_rows``."""
        return self.incremental_chunk_rows or 3 * self.chunk_rows


class SchemaChangesConfig(_Model):
    resnapshot: Literal["auto", "never"] = Field(
        "auto",
        description="auto | never: re-snapshot a table after a migration that changed its rows "
        "without row changes in the WAL (a rewrite); never logs one warning per skipped heal "
        "(docs/schema-changes.md)",
    )
    check_interval_s: float = Field(
        60.0,
        ge=0,
        description="seconds between comparisons of every captured table's recorded shape with "
        "the catalog, which finds migrations of tables that are not written again; 0: off",
    )


class MetricsConfig(_Model):
    listen: str = Field(
        "0.0.0.0:9187",
        description="host:port for /metrics, /healthz, /readyz; port 0..65535 (0: a free port), "
        "IPv6 bracketed ([::]:9187)",
    )
    log_format: Literal["text", "json"] = Field("text", description="text or json log lines")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    lag_sample_interval_s: float = Field(
        5.0,
        gt=0,
        le=300,
        description="how often the slot metrics (cdcd_slot_lag_bytes, cdcd_slot_retained_wal_bytes, "
        "cdcd_slot_wal_status, cdcd_slot_wal_keep_size_bytes, "
        "cdcd_slot_inactive_since_timestamp_seconds) are measured: two queries on the source",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, listen: str) -> str:
        # The same rules as cdcd.observability.http.parse_listen, checked here so
        # `check` and `run` reject the file before anything starts. Port 0 (a
        # free port chosen by the kernel) stays allowed.
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{listen!r} is not host:port (e.g. 0.0.0.0:9187)")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            raise ValueError(f"{listen!r}: IPv6 addresses must be bracketed, e.g. [::]:9187")
        if int(port) > 65535:
            raise ValueError(f"port {int(port)} is out of range 0..65535")
        return listen


class HeartbeatConfig(_Model):
    interval_s: float = Field(
        30.0, ge=0, description="pg_logical_emit_message heartbeat interval; 0 disables"
    )


class CdcdConfig(_Model):
    postgres: PostgresConfig
    kafka: KafkaConfig
    schema_registry: SchemaRegistryConfig = Field(default_factory=lambda: SchemaRegistryConfig())
    snapshot: SnapshotConfig = Field(default_factory=lambda: SnapshotConfig())
    schema_changes: SchemaChangesConfig = Field(default_factory=lambda: SchemaChangesConfig())
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig())
    heartbeat: HeartbeatConfig = Field(default_factory=lambda: HeartbeatConfig())

    def table_topic(self, schema: str, table: str) -> str:
        """The topic of ``schema.table``: its entry's ``topic``, else ``<prefix>.<schema>.<table>``."""
        override = self.postgres.topic_overrides().get((schema, table))
        return override or table_topic(self.kafka.topic_prefix, schema, table)

    def subscription(self) -> tuple[list[str], str | None]:
        """What a consumer of every captured table subscribes to: topics, or a regex.

        Listed tables give their topics. A pattern entry (``public.*``) or no
        list at all needs a regex, since the tables it expands to are known
        only to the catalog: the pattern's globs over the topic name's two
        components (a name that a topic has to rewrite, see
        :mod:`cdcd.naming`, is not matched by a pattern).
        """
        tables = self.postgres.tables
        prefix = re.escape(self.kafka.topic_prefix)
        if not tables:
            return [], table_topic_pattern(self.kafka.topic_prefix)
        topics: list[str] = []
        regexes: list[str] = []
        for entry in tables:
            name = entry if isinstance(entry, str) else entry.name
            globs = table_globs(name)
            if globs is None:
                parsed = parse_table(name)
                assert parsed is not None  # validated
                topics.append(self.table_topic(*parsed))
            else:
                schema_re, table_re = (topic_glob_regex(g) for g in globs)
                regexes.append(rf"{prefix}\.{schema_re}\.{table_re}")
        if not regexes:
            return topics, None
        regexes += [re.escape(t) for t in topics]
        return [], "^(?:" + "|".join(regexes) + ")$"

    def redacted(self) -> dict[str, Any]:
        """The configuration as a dict with every secret masked."""
        data = self.model_dump()
        data["postgres"]["dsn"] = redact_dsn(self.postgres.dsn.get_secret_value())
        producer = data["kafka"]["producer"]
        for key in producer:
            if is_secret_key(key, PRODUCER_SECRET_KEYS):
                producer[key] = "***"
        registry = data["schema_registry"]
        for key in registry["config"]:
            if is_secret_key(key, REGISTRY_SECRET_KEYS):
                registry["config"][key] = "***"
        if registry["url"]:
            # https://user:password@host: everything up to the last "@" after a
            # scheme is credentials (a raw "/" or "@" in a password stays masked).
            registry["url"] = re.sub(r"(//)[^,]*@", r"\1***@", registry["url"])
        return data


def _env_value(match: re.Match[str]) -> str:
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


def expand_env(text: str) -> str:
    """Replace ``${VAR}`` / ``${VAR:-default}``; a missing variable without default is an error."""
    return _ENV.sub(_env_value, text)


def expand_dsn(template: str) -> str:
    """``expand_env`` for a libpq DSN: each value is quoted (keyword form) or percent-encoded (URI).

    ``password=${PGPASSWORD}`` with ``PGPASSWORD='it's a secret'`` gives
    ``password='it\\'s a secret'``, which libpq reads back exactly.
    """
    return substitute_dsn(template, _ENV, _env_value)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (``X``, ``X | None``, ``list[str | X]``...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def _locate(loc: tuple[int | str, ...]) -> tuple[str, type[BaseModel] | None]:
    """The dotted path of ``loc`` and the model that owns its last key.

    pydantic puts the member's class name into the location of a union
    (``postgres.tables.0.TableConfig.nme``); it is dropped from the path.
    """
    candidates: list[type[BaseModel]] = [CdcdConfig]
    parts: list[str] = []
    for part in loc[:-1]:
        named = [c for c in candidates if c.__name__ == part]
        if named:
            candidates = named
            continue
        parts.append(str(part))
        if isinstance(part, int):
            continue  # a list index: the same candidate models
        owner = next((c for c in candidates if part in c.model_fields), None)
        candidates = _models_in(owner.model_fields[str(part)].annotation) if owner else []
    if loc:
        parts.append(str(loc[-1]))
    return ".".join(parts) or "(top level)", candidates[0] if len(candidates) == 1 else None


def _suggestion(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return ""
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _describe(error: Any, source: str) -> str:
    loc = tuple(error["loc"])
    field, model = _locate(loc)
    if error["type"] == "extra_forbidden":
        return f"{source}: unknown key '{field}'{_suggestion(str(loc[-1]), model)}"
    if error["type"] == "missing":
        return f"{source}: '{field}' is required"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{source}: '{field}': {message}"


def parse_config(data: Any, source: str = "configuration") -> CdcdConfig:
    """Validate already-loaded YAML data; every error is reported, unknown keys first.

    A typo'd key (``bootstrap_server``) also makes the real one missing; the
    unknown key with the nearest known name is what the operator must fix, so
    the missing one it stands for is not reported again.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return CdcdConfig.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        unknown = [e for e in errors if e["type"] == "extra_forbidden"]
        # A typo'd key's "did you mean" target is reported missing too: said once.
        implied: set[tuple[Any, ...]] = set()
        for error in unknown:
            loc = tuple(error["loc"])
            _, model = _locate(loc)
            if model is not None:
                close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
                implied.update((*loc[:-1], name) for name in close)
        rest = [
            e
            for e in errors
            if e["type"] != "extra_forbidden" and not (e["type"] == "missing" and tuple(e["loc"]) in implied)
        ]
        described = [_describe(e, source).removeprefix(f"{source}: ") for e in unknown + rest]
        raise ConfigError(f"{source}: " + "; ".join(described)) from exc


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


#: Where ``${VAR}`` is quoted for libpq instead of inserted as it is.
_DSN_PATH = ("postgres", "dsn")


def _expand_values(data: Any, path: tuple[Any, ...] = ()) -> Any:
    if isinstance(data, str):
        return expand_dsn(data) if path == _DSN_PATH else expand_env(data)
    if isinstance(data, dict):
        return {key: _expand_values(value, (*path, key)) for key, value in data.items()}
    if isinstance(data, list):
        return [_expand_values(value, (*path, index)) for index, value in enumerate(data)]
    return data
