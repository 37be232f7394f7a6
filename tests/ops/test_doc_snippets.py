"""Every code snippet of the README and docs/ is exercised (issue 29), or says why it cannot be.

Each fenced block is found by its language and handled by the one rule for
that language:

* ``yaml``: a cdcd configuration (a ``postgres`` or ``kafka`` section),
  completed with a placeholder DSN and broker where the snippet shows only
  one section, must pass the configuration's validation; other YAML must parse;
* ``sh``: every ``cdcd …`` command line must be accepted by the command
  line parser as written (the command and every option exist); the other
  commands (installers, docker, spark-submit) are not run here;
* ``sql`` for PostgreSQL: run, file by file on a fresh database, the
  ``CREATE`` statements first, then the rest in document order (integration);
  not the server-wide ``ALTER SYSTEM`` ones (the test cluster is shared);
* ``json`` parses; ``ini`` parses as a systemd drop-in;
* ``promql``: every expression (one per line) is checked by ``promtool``
  as a recording rule, and every ``cdcd_`` series it reads must be one
  cdcd exports;
* ``python``: run by the sibling ``test_doc_python_snippets.py`` (from a
  non-activated virtualenv, with a mirror, a broker or Spark as a block needs);
* no language: sample output, not code.

A block preceded by ``<!-- snippet: not run: REASON -->`` (an HTML comment,
invisible once rendered) is not run; :data:`NOT_RUN` lists the reasons
accepted, so a new one shows here. Today: the DuckDB queries of
docs/spark.md (DuckDB is not a dependency; the python readers run instead).

A block in a language without a rule fails the inventory test, so a new
kind of snippet cannot go unnoticed.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from cdcd import cli
from cdcd.config.model import parse_config
from cdcd.observability.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Languages with a rule here (see the module docstring); "" is no language.
RULES = {"yaml", "sh", "sql", "json", "ini", "python", "promql", ""}
PLACEHOLDER = {"postgres": {"dsn": "host=db dbname=app user=cdc"},
               "kafka": {"bootstrap_servers": "kafka:9092"}}


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def snippets() -> list[Snippet]:
    out = []
    for path in DOCUMENTS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            opening = re.match(r"^\s*(```+)(\S*)", lines[i])
            if opening is None:
                i += 1
                continue
            fence, lang = opening.group(1), opening.group(2)
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence):
                end += 1
            out.append(Snippet(path, i + 1, lang, "\n".join(lines[i + 1:end])))
            i = end + 1
    return out


ALL = snippets()

MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<what>.*?)\s*-->\s*$")


def marker(snippet: Snippet) -> str:
    """What the ``<!-- snippet: ... -->`` comment on the line above the fence says ("" if none)."""
    lines = snippet.path.read_text(encoding="utf-8").splitlines()
    found = MARKER.match(lines[snippet.line - 2]) if snippet.line >= 2 else None
    return found.group("what") if found else ""


def not_run(snippet: Snippet) -> str | None:
    """The reason a block is not run, or None."""
    what = marker(snippet)
    return what.removeprefix("not run:").strip() if what.startswith("not run:") else None


#: Reasons for not running a (non-python) block, and how many blocks give each.
NOT_RUN = {
    "DuckDB is not a dependency of cdcd; the same Delta tables are read by the deltalake "
    "and read_mirror blocks": 2,
}


def of(lang: str) -> list[Snippet]:
    return [s for s in ALL if s.lang == lang]


def test_every_snippet_has_a_rule() -> None:
    unknown = [f"{s.where} ({s.lang})" for s in ALL if s.lang not in RULES]
    assert not unknown, f"snippets in a language this test has no rule for: {unknown}"


def test_blocks_not_run_are_the_listed_ones() -> None:
    reasons: dict[str, int] = {}
    for snippet in ALL:
        reason = not_run(snippet)
        if reason is not None and snippet.lang != "python":
            reasons[reason] = reasons.get(reason, 0) + 1
    assert reasons == NOT_RUN
    duckdb = [s.where for s in of("sql") if "DuckDB" in s.text and not_run(s) is None]
    assert not duckdb, f"DuckDB queries would run on PostgreSQL: {duckdb}"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


@pytest.mark.parametrize("snippet", of("yaml"), ids=lambda s: s.where)
def test_yaml_snippet(snippet: Snippet) -> None:
    data = yaml.safe_load(re.sub(r"\$\{(\w+)\}", r"x\1", snippet.text))
    if isinstance(data, dict) and ({"postgres", "kafka"} & set(data)):
        parse_config(_merge(PLACEHOLDER, data), snippet.where)


def _commands(text: str) -> list[list[str]]:
    """The ``cdcd …`` command lines of a shell snippet, as argument lists."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        for part in re.split(r"&&|\|\||;", line.split(" #", 1)[0]):
            words = shlex.split(part.strip(), comments=True) if part.strip() else []
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value prefixes
            if words and Path(words[0]).name == "cdcd":
                out.append(words[1:])
    return out


SH = [(s, argv) for s in of("sh") for argv in _commands(s.text)]


@pytest.mark.parametrize(("snippet", "argv"), SH, ids=[f"{s.where} {a[0]}" for s, a in SH])
def test_cdcd_command_line_in_sh_snippet(snippet: Snippet, argv: list[str]) -> None:
    # Optional parts written as [--table …] are documentation, not shell.
    plain = [a for a in argv if not a.startswith("[") and not a.endswith("]")]
    try:
        cli.build_parser().parse_args(plain)
    except SystemExit as exc:  # --version, --help: printed and done
        assert exc.code == 0, exc


def test_the_sh_snippets_name_cdcd_commands() -> None:
    assert len(SH) >= 10, [s.where for s, _ in SH]


@pytest.mark.parametrize("snippet", of("json"), ids=lambda s: s.where)
def test_json_snippet(snippet: Snippet) -> None:
    json.loads(snippet.text)


@pytest.mark.parametrize("snippet", of("ini"), ids=lambda s: s.where)
def test_ini_snippet(snippet: Snippet) -> None:
    configparser.ConfigParser(strict=False, interpolation=None).read_string(snippet.text)


#: Server-wide settings (ALTER SYSTEM) would change the cluster every other test shares.
SERVER_WIDE = re.compile(r"\bALTER\s+SYSTEM\b", re.IGNORECASE)
POSTGRES_SQL = [s for s in of("sql") if not_run(s) is None and not SERVER_WIDE.search(s.text)]


@pytest.mark.integration
@pytest.mark.parametrize("path", sorted({s.path for s in POSTGRES_SQL}),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_sql_snippets_run_on_postgresql(pg: Any, path: Path) -> None:
    conn = pg.connect()
    ordered = sorted((s for s in POSTGRES_SQL if s.path == path),
                     key=lambda s: not s.text.lstrip().upper().startswith("CREATE"))
    for snippet in ordered:
        with conn.cursor() as cur:
            try:
                cur.execute(snippet.text)
            except Exception as exc:  # noqa: BLE001 - reported with the snippet
                pytest.fail(f"{snippet.where}: {exc}\n{snippet.text}")


@pytest.mark.parametrize("snippet", of("promql"), ids=lambda s: s.where)
def test_promql_snippet(snippet: Snippet, tmp_path: Path) -> None:
    expressions = [line.split("#", 1)[0].strip() for line in snippet.text.splitlines()]
    expressions = [e for e in expressions if e]
    registry = CollectorRegistry()
    Metrics(registry, process_collectors=False).table("public.t")
    exported = {sample.name for family in registry.collect() for sample in family.samples}
    for expression in expressions:
        unknown = {n for n in re.findall(r"\bcdcd_\w+", expression) if n not in exported}
        assert not unknown, f"{snippet.where}: {expression} reads series cdcd does not export"
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not found (Debian package 'prometheus'); series names checked")
    rules = {"groups": [{"name": "snippet", "rules": [
        {"record": f"snippet:{n}", "expr": e} for n, e in enumerate(expressions)]}]}
    path = tmp_path / "snippet-rules.yaml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    result = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, f"{snippet.where}:\n{result.stdout}{result.stderr}"
