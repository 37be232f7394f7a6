"""Delivery acknowledgement: which LSN may be confirmed to the slot (see :mod:`cdcd.ack.tracker`)."""

from cdcd.ack.tracker import AckTracker, DeliveryClassifier, Hold, TxnTicket

__all__ = ["AckTracker", "DeliveryClassifier", "Hold", "TxnTicket"]
