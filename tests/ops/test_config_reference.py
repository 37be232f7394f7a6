"""docs/configuration.md is generated from the models and must be current; the example loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cdcd.config import CdcdConfig, load_config
from cdcd.config.reference import main, render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
EXAMPLE = ROOT / "config" / "cdcd.example.yaml"


def test_committed_reference_is_up_to_date() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is stale: run "
        "`python -m cdcd.config.reference > docs/configuration.md`"
    )


def test_module_entry_point_prints_the_reference() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cdcd.config.reference"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.stdout == render()


def test_check_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check", str(DOC)]) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err


def test_every_key_is_documented() -> None:
    text = render()
    for section, field in CdcdConfig.model_fields.items():
        assert f"## `{section}`" in text
        model = field.annotation
        assert isinstance(model, type)
        for key in model.model_fields:
            assert f"| `{key}` |" in text, f"{section}.{key}"
    assert "**required**" in text  # postgres.dsn, kafka.bootstrap_servers
    assert "| `protocol_version` | integer; ≥ 1, ≤ 4 | `1` |" in text
    assert "one of `initial`, `never`, `initial_only`" in text
    # Angle brackets outside code spans are escaped so Markdown keeps them.
    assert "&lt;prefix&gt;" in text


def test_example_configuration_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGPASSWORD", "example-secret")
    monkeypatch.delenv("CDCD_SPILL_DIR", raising=False)
    config = load_config(EXAMPLE)
    assert "password=example-secret" in config.postgres.dsn.get_secret_value()
    assert config.postgres.spill_dir == "/var/lib/cdcd"
    assert config.redacted()["postgres"]["dsn"].endswith("password=***")
    # Every section is shown, so the example doubles as a tour of the file.
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert set(raw) == set(CdcdConfig.model_fields)


def test_example_configuration_needs_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    from cdcd.errors import ConfigError

    monkeypatch.delenv("PGPASSWORD", raising=False)
    with pytest.raises(ConfigError, match="PGPASSWORD"):
        load_config(EXAMPLE)
