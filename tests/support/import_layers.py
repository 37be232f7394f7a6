"""The package import graph of cdcd, checked against the layers of the data flow.

Run ``python -m tests.support.import_layers`` from the repository root: it
prints every edge between cdcd's packages (``a -> b``, with how many import
statements make it), then each violation with the lines that cause it, and
exits 1 on an import cycle between packages, an upward import (against
:data:`LAYERS`), a dependency a package is not allowed (:data:`ONLY_USES`,
:data:`ONLY_USED_BY`) or a package missing from the table; 0 otherwise.

A "package" is a first-level name under ``cdcd/``: a subpackage
(``cdcd.decode``) or a top-level module (``cdcd.daemon``); ``cdcd`` itself
(``cdcd/__init__.py``, the version) is the unit ``cdcd``. Imports are read with
``ast``, so function-level imports and ``if TYPE_CHECKING:`` imports count
(an import that only runs later is still a dependency), and so do modules
named by a string in a call, such as the CLI's lazy ``importlib`` commands
(logger names excepted).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Rank of every package: a package may import only packages of a strictly
#: lower rank, so there can be no cycle either. Equal ranks are independent
#: of each other. The order is the README's data flow, bytes in to Kafka out,
#: then the stages that drive it.
LAYERS: dict[str, int] = {
    # The base: the error model and the version; they import nothing of cdcd.
    "errors": 0,
    "cdcd": 0,
    # Topic, header and table names and wire magic: pure, asked by producer and
    # consumers alike, so it sits under all of them (it raises cdcd errors).
    "naming": 1,
    # Configuration and observability (logs, metrics, HTTP endpoints) are used
    # by every stage, so they may only use the base and naming.
    "config": 2,
    "observability": 2,
    # pgoutput bytes -> messages, no I/O; and the Avro binary primitives, which
    # both decode (values) and envelope (records) write with.
    "protocol": 3,
    "avro": 3,
    # Messages -> relations and column values (Avro bytes).
    "decode": 4,
    # Decoded rows -> envelopes: schemas, keys, wire format.
    "envelope": 5,
    # Envelopes -> Kafka: producer, delivery reports, topics. And delivery
    # reports -> confirmable LSN: the same rank, so neither imports the other;
    # the pipeline hands the tracker's callbacks to the sink and the sink's
    # classifier to the tracker.
    "sink": 6,
    "ack": 6,
    # What every reader of the topics needs (wire headers, the _schemas topic,
    # the registry): above the envelope whose names it reads, beside the sink.
    "consumer": 6,
    # The source database: replication connection, slot, catalog (needs
    # decode's type catalog), feedback with the confirmed LSN.
    "source": 7,
    # Snapshots read the source and publish through a publisher protocol of
    # their own (cdcd.snapshot.publisher), so they sit below the pipeline.
    "snapshot": 8,
    # Wires source -> protocol -> transactions -> publisher -> sink -> ack,
    # and starts snapshots.
    "pipeline": 9,
    # The daemon runs a pipeline session with its HTTP endpoints and signals.
    "daemon": 10,
    # The Spark consumer reads what cdcd wrote; nothing of the daemon's stack
    # (see ONLY_USES). Only the CLI's ``mirror`` command uses it.
    "spark": 10,
    # cdcd tail: a plain reader of the topics (the consumer side, no Spark).
    "tail": 10,
    # check runs the daemon's startup checks.
    "check": 11,
    # The operator tools beside the daemon (cdcd.tools): demo (a daemon against
    # throwaway servers), bench (runs a pipeline), the throwaway PostgreSQL and
    # broker (tools.local, also the tests'), check's presentation. Nothing of
    # the daemon may use them (ONLY_USED_BY).
    "tools": 12,
    # The command line dispatches to all of them; __main__ runs it.
    "cli": 13,
    "__main__": 14,
}

#: Packages whose dependencies are limited to a list, beyond their rank: a
#: package name allows all of it, ``package.module`` only that module.
ONLY_USES: dict[str, frozenset[str]] = {
    # The Spark reader runs inside Spark executors and decodes what cdcd wrote:
    # names, the envelope's schemas and wire format (through the consumer
    # module), config for its settings, errors and logging. Replication, the
    # producer or the pipeline there would mean it depends on how cdcd
    # produces instead of on what it wrote.
    "spark": frozenset(
        {"cdcd", "errors", "naming", "config", "observability", "envelope", "consumer"}
    ),
    # The consumer side reads what was written: names, the envelope's schema
    # names, config; nothing of how it is produced.
    "consumer": frozenset({"cdcd", "errors", "naming", "config", "envelope"}),
    # cdcd tail reads what was written, as any consumer: nothing of how it is produced.
    "tail": frozenset(
        {"cdcd", "errors", "naming", "config", "envelope", "consumer", "protocol.lsn"}
    ),
}

#: Packages only the listed packages may import.
ONLY_USED_BY: dict[str, frozenset[str]] = {
    # Demo, bench and throwaway servers are the operator's and the tests',
    # never the daemon's or anything it runs: only the command line starts them.
    "tools": frozenset({"cli"}),
}


@dataclass(frozen=True)
class Site:
    """One import of a module of package ``target`` in file ``path`` at ``line``."""

    path: str
    line: int
    module: str
    dynamic: bool


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The package of a ``cdcd...`` module name: its first component below ``cdcd``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "cdcd"


def _exists(module: str, root: Path = ROOT) -> bool:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module of ``from X import ...`` (relative imports included)."""
    if node.level == 0:
        return node.module
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(
    tree: ast.AST, module: str, is_package: bool, root: Path = ROOT
) -> list[tuple[int, str, bool]]:
    """``(line, module, dynamic)`` of every cdcd module this file imports or names in a call."""
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, False) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(node, module, is_package)
            if source is None:
                continue
            # ``from cdcd import daemon`` imports a module; ``from cdcd import
            # __version__`` a name of the package. One statement counts once
            # per module it reaches, however many names it takes.
            modules = {
                f"{source}.{alias.name}" if _exists(f"{source}.{alias.name}", root) else source
                for alias in node.names
            }
            found.extend((node.lineno, m, False) for m in sorted(modules))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "getLogger":
                continue
            for arg in node.args:
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value.startswith("cdcd.")
                    and _exists(arg.value, root)
                ):
                    found.append((node.lineno, arg.value, True))
    return [t for t in found if t[1] == "cdcd" or t[1].startswith("cdcd.")]


def import_graph(package_dir: Path | None = None) -> dict[tuple[str, str], list[Site]]:
    """Every edge between different packages of cdcd, with the imports that make it.

    ``package_dir`` (default: this repository's ``cdcd``) may be a copy elsewhere:
    module names are read relative to its parent.
    """
    package_dir = package_dir or ROOT / "cdcd"
    root = package_dir.parent
    edges: dict[tuple[str, str], list[Site]] = defaultdict(list)
    for path in sorted(package_dir.rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        source = _unit(module)
        for line, target, dynamic in _targets(tree, module, path.name == "__init__.py", root):
            dest = _unit(target)
            if dest != source:
                rel = str(path.relative_to(root))
                edges[(source, dest)].append(Site(rel, line, target, dynamic))
    return dict(edges)


def _cycles(edges: dict[tuple[str, str], list[Site]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted({n for edge in edges for n in edge}):
        if node not in index:
            visit(node)
    return found


def violations(edges: dict[tuple[str, str], list[Site]]) -> list[str]:
    """One line per broken rule, each followed by the import sites that break it."""
    problems: list[str] = []
    units = sorted(
        {n for edge in edges for n in edge}
        | {_unit(_module_name(p)) for p in (ROOT / "cdcd").rglob("*.py")}
    )
    for unit in units:
        if unit not in LAYERS:
            problems.append(f"package {unit!r} has no layer: add it to LAYERS in {__name__}")
    for component in _cycles(edges):
        problems.append("import cycle between packages: " + " <-> ".join(component))
    for (a, b), sites in sorted(edges.items()):
        why: list[tuple[str, list[Site]]] = []
        if a in LAYERS and b in LAYERS and LAYERS[b] >= LAYERS[a]:
            why.append(
                (
                    f"upward or sideways import: {a} (layer {LAYERS[a]}) -> {b} (layer {LAYERS[b]})",
                    sites,
                )
            )
        if a in ONLY_USES:
            allowed = ONLY_USES[a]
            refused = [s for s in sites if not _allowed(s.module, allowed)]
            if refused:
                why.append((f"{a} may only use {', '.join(sorted(allowed))}, not {b}", refused))
        if b in ONLY_USED_BY and a not in ONLY_USED_BY[b]:
            allowed = ONLY_USED_BY[b]
            why.append((f"{b} may only be used by {', '.join(sorted(allowed))}, not {a}", sites))
        for reason, culprits in why:
            problems.append(reason)
            problems.extend(
                f"    {s.path}:{s.line} {s.module}{' (by name)' if s.dynamic else ''}"
                for s in culprits
            )
    return problems


def _allowed(module: str, allowed: frozenset[str]) -> bool:
    """Whether ``module`` (``cdcd.x.y``) is a package or module named in ``allowed``."""
    name = module.removeprefix("cdcd.") if module != "cdcd" else "cdcd"
    return any(name == entry or name.startswith(entry + ".") for entry in allowed)


def main() -> int:
    edges = import_graph()

    def order(edge: tuple[str, str]) -> tuple[int, str, int, str]:
        a, b = edge
        return (-LAYERS.get(a, 99), a, -LAYERS.get(b, 99), b)

    print("cdcd package import graph (edge, import statements; * = also named in a call)")
    for edge in sorted(edges, key=order):
        sites = edges[edge]
        print(
            f"  {edge[0]} -> {edge[1]} {len(sites)}{' *' if any(s.dynamic for s in sites) else ''}"
        )
    problems = violations(edges)
    if problems:
        broken = sum(not line.startswith(" ") for line in problems)
        print(f"\nFAILED: {broken} layer rule(s) broken")
        for line in problems:
            print(line)
        return 1
    print(f"\nOK: {len(edges)} edges, no cycle, no upward import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
