"""The product's help and documents are self-contained (issue 29, friction 5).

They used to cite "SPEC §…", a document the repository does not ship. Every
help text of the command line, the README, docs/, config/ and deploy/ must
state what they promise themselves (docs/envelope.md holds the contract of
what lands in Kafka).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cdcd import cli

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
           *sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file()),
           *sorted((ROOT / "config").glob("*"))]


def helps() -> dict[str, str]:
    parser = cli.build_parser()
    out = {"cdcd": parser.format_help()}
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for name, sub in action.choices.items():
            out[f"cdcd {name}"] = sub.format_help()
    return out


def test_help_cites_no_document_outside_the_repository() -> None:
    cited = {name: text for name, text in helps().items() if "SPEC" in text}
    assert not cited, cited


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_cite_no_document_outside_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [f"{n}: {line}" for n, line in enumerate(text.splitlines(), 1) if "SPEC" in line]
    assert not lines, "\n".join(lines)
