"""Units of the many-daemons pieces: which slot a job row is addressed to, and check's lines."""

from __future__ import annotations

from cdcd.snapshot.daemons import DaemonRecord, Neighbour, sharing_report, slot_owner
from cdcd.snapshot.store import addressed_to


def test_a_job_row_is_addressed_by_data_slot_or_by_a_heal_id() -> None:
    assert addressed_to("x", {"data-collections": ["public.t"], "slot": "a"}) == "a"
    assert addressed_to("x", '{"slot": "b"}') == "b"  # jsonb as text
    # Heals requested before jobs carried data.slot: the id names the slot.
    assert addressed_to("schema-change:cdcd_a:public.t:123", {"data-collections": []}) == "cdcd_a"
    assert addressed_to("adhoc-1", {"data-collections": ["public.t"]}) is None
    assert addressed_to("adhoc-2", ["not", "an", "object"]) is None


def test_slot_owner_needs_every_table() -> None:
    a = DaemonRecord("a", "pa", ("public.x", "public.y"))
    b = DaemonRecord("b", "pb", ("public.z",))
    assert slot_owner([a, b], ["public.x", "public.y"]) == a
    assert slot_owner([a, b], ["public.x", "public.z"]) is None
    assert slot_owner([a, b], []) is None


def test_sharing_report_lines() -> None:
    same_pub = Neighbour("b", "pgoutput", True, DaemonRecord("b", "cdcd", ("public.y",)))
    overlap = Neighbour("c", "pgoutput", False, DaemonRecord("c", "pc", ("public.x",)))
    stranger = Neighbour("sub", "pgoutput", True, None)
    lines = sharing_report([same_pub, overlap, stranger], "a", "cdcd", ["public.x"])
    failed = [text for ok, text in lines if not ok]
    assert len(failed) == 1 and "publication cdcd is also used by the daemon of slot b" in failed[0]
    texts = "\n".join(text for _, text in lines)
    assert "public.x captured by slot c too" in texts
    assert "slot sub (pgoutput, streaming) also decodes this database" in texts
    assert not [t for ok, t in sharing_report([overlap], "a", "cdcd", ["public.w"]) if not ok]
