"""Reading ``synchronous_standby_names`` as PostgreSQL does (cdcd.source.synchronous)."""

from __future__ import annotations

import pytest

from cdcd.source.synchronous import StandbyNames, parse_standby_names


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("", None),
        ("  ", None),
        ("cdcd", StandbyNames("FIRST", 1, ("cdcd",))),
        ("s1, cdcd", StandbyNames("FIRST", 1, ("s1", "cdcd"))),
        ("2 (s1, s2, cdcd)", StandbyNames("FIRST", 2, ("s1", "s2", "cdcd"))),
        ("FIRST 1 (cdcd, s1)", StandbyNames("FIRST", 1, ("cdcd", "s1"))),
        ("any 1(cdcd,s1)", StandbyNames("ANY", 1, ("cdcd", "s1"))),
        ('ANY 2 ("a, b", "say ""hi""", *)', StandbyNames("ANY", 2, ("a, b", 'say "hi"', "*"))),
    ],
)
def test_parse(setting: str, expected: StandbyNames | None) -> None:
    assert parse_standby_names(setting) == expected


def test_entry_names_cdcd_case_insensitively_or_through_star() -> None:
    names = parse_standby_names("FIRST 1 (S1, CDCD_Prod)")
    assert names is not None and names.entry_for("cdcd_prod") == "CDCD_Prod"
    assert names.entry_for("other") is None
    star = parse_standby_names("ANY 1 (s1, *)")
    assert star is not None and star.entry_for("cdcd") == "*"
    # A name listed beside '*' is the entry that names it.
    both = parse_standby_names("cdcd, *")
    assert both is not None and both.entry_for("CDCD") == "cdcd"
