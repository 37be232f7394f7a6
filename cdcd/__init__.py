"""cdcd: PostgreSQL change-data-capture to Kafka, confirmed only after delivery.

Data flows through the subpackages in this order::

    protocol (bytes -> messages) -> decode (relations, values, transactions)
    -> envelope (schemas, keys, Avro) -> sink (producer, delivery)
    -> ack (LSN tracker) -> source (walsender connection, slot)

``pipeline`` and ``daemon`` wire them together; ``observability``, ``config``,
``cli`` and ``spark`` stand beside.
"""

__version__ = "0.1.0"
