"""Configuration: one YAML file validated by pydantic v2; unknown keys are rejected."""

from cdcd.config.model import (
    CdcdConfig,
    HeartbeatConfig,
    KafkaConfig,
    MetricsConfig,
    PostgresConfig,
    SchemaRegistryConfig,
    SnapshotConfig,
    load_config,
    parse_config,
)

__all__ = [
    "CdcdConfig",
    "HeartbeatConfig",
    "KafkaConfig",
    "MetricsConfig",
    "PostgresConfig",
    "SchemaRegistryConfig",
    "SnapshotConfig",
    "load_config",
    "parse_config",
]
