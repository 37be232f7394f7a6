"""The Kafka side of the pipeline: producer, error classification, topic management."""

from cdcd.sink.producer import (
    KafkaSink,
    ProducerFatalError,
    build_producer_config,
    classify_delivery_error,
)
from cdcd.sink.topics import (
    TopicSpec,
    admin_config,
    check_broker,
    ensure_topics,
    topic_spec,
)

__all__ = [
    "KafkaSink",
    "ProducerFatalError",
    "TopicSpec",
    "admin_config",
    "build_producer_config",
    "check_broker",
    "classify_delivery_error",
    "ensure_topics",
    "topic_spec",
]
