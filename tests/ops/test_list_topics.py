"""``cdcd tail`` and the Spark source list topics through one helper: a broker that does not
answer is a transient error naming where cdcd looked and how long it waited."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdcd.consumer import list_topics
from cdcd.errors import TransientError


class _Unanswered:
    """A consumer whose metadata request times out."""

    def list_topics(self, timeout: float) -> Any:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata"))


class _Answered:
    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def list_topics(self, timeout: float) -> str:
        self.timeouts.append(timeout)
        return "metadata"


def test_an_unanswered_metadata_request_is_transient() -> None:
    with pytest.raises(TransientError) as caught:
        list_topics(_Unanswered(), "k1:9092,k2:9092", 2.5)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "cannot list topics at k1:9092,k2:9092 within 2.5 s" in message
    assert "Failed to get metadata" in message
    assert isinstance(caught.value.__cause__, KafkaException)


def test_the_answer_is_returned_as_it_is() -> None:
    consumer = _Answered()
    assert list_topics(consumer, "k:9092", 7.0) == "metadata"  # type: ignore[arg-type]
    assert consumer.timeouts == [7.0]
