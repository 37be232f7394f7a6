"""Secrets in the DSN are quoted the libpq way and never printed (SPEC §3, issue 12).

``password=${PGPASSWORD}`` with a password holding a space used to expand into
``password=my tail-secret`` (libpq: a syntax error) and print as
``password=*** tail-secret``. Now the expansion quotes the value (keyword form)
or percent-encodes it (URI form), so libpq reads back exactly the variable's
value, and ``redact_dsn`` masks the whole value, however it is written.

What "no leak" means here: for a DSN built from a fixed template, the redacted
text equals the template with the password replaced by ``***``, character for
character; so no piece of the secret, of any length, can be in it. For
arbitrary (also malformed) text, every value libpq would read for a
``*password*`` keyword is masked, nothing else changes, and text that libpq
cannot parse is masked from the first ``password`` to the end.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import unquote

import psycopg2
import psycopg2.extensions
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.cdc import DaemonProcess, run_cdcd, wait_streaming

from cdcd.config.dsn import DsnSyntaxError, parse_keyword_dsn, redact_dsn_message
from cdcd.config.model import CdcdConfig, expand_dsn, load_config, parse_config, redact_dsn
from cdcd.config.secrets import reveal
from cdcd.errors import ConfigError

# ---------------------------------------------------------------------------- strategies

#: Characters that matter to libpq's two grammars, mixed with ordinary text.
SPECIAL = " \t\n'\"=\\@:/%#&?+,;$"
secrets_text = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1),
    st.text(st.sampled_from(list(SPECIAL + "ab3é")), min_size=1, max_size=30),
)

#: (template, what redact_dsn must print for it, keywords the template fixes).
TEMPLATES = [
    (
        "host=db port=5432 dbname=app user=cdc password=${PGPASSWORD}",
        "host=db port=5432 dbname=app user=cdc password=***",
        {"host": "db", "port": "5432", "dbname": "app", "user": "cdc"},
    ),
    (
        "host=db password=${PGPASSWORD} user=cdc",
        "host=db password=*** user=cdc",
        {"host": "db", "user": "cdc"},
    ),
    (
        "host=db password='${PGPASSWORD}' user=cdc",
        "host=db password=*** user=cdc",
        {"host": "db", "user": "cdc"},
    ),
    (
        "host=db password = ${PGPASSWORD}\tuser=cdc",
        "host=db password = ***\tuser=cdc",
        {"host": "db", "user": "cdc"},
    ),
    (
        "postgresql://cdc:${PGPASSWORD}@db:5432/app?sslmode=disable",
        "postgresql://cdc:***@db:5432/app?sslmode=disable",
        {"host": "db", "port": "5432", "dbname": "app", "user": "cdc", "sslmode": "disable"},
    ),
    (
        "postgresql://cdc@db/app?password=${PGPASSWORD}&sslmode=disable",
        "postgresql://cdc@db/app?password=***&sslmode=disable",
        {"host": "db", "dbname": "app", "user": "cdc", "sslmode": "disable"},
    ),
]


def environment(**values: str) -> Any:
    """``with environment(NAME=value):`` those variables set, then as they were."""
    return mock.patch.dict(os.environ, values)


# ---------------------------------------------------------------------------- expansion


@pytest.mark.parametrize(("template", "redacted", "fixed"), TEMPLATES)
@settings(max_examples=150, deadline=None)
@given(secret=secrets_text)
@example(secret="my tail-secret")
@example(secret="it's a \\ secret = yes")
@example(secret="p@ss:w/rd%20#frag&x=y?")
def test_expanded_dsn_reads_back_the_password_and_redacts_entirely(
    template: str, redacted: str, fixed: dict[str, str], secret: str
) -> None:
    with environment(PGPASSWORD=secret):
        dsn = expand_dsn(template)
    parsed = psycopg2.extensions.parse_dsn(dsn)
    assert parsed == {**fixed, "password": secret}
    assert redact_dsn(dsn) == redacted


def test_the_issue_example_no_longer_prints_part_of_the_password() -> None:
    with environment(PGPASSWORD="my tail-secret"):
        dsn = expand_dsn("host=db user=cdc password=${PGPASSWORD}")
    assert dsn == "host=db user=cdc password='my tail-secret'"
    assert redact_dsn(dsn) == "host=db user=cdc password=***"
    # Written unquoted into the file it is malformed: everything after password is masked.
    assert redact_dsn("host=db password=my tail-secret") == "host=db password=***"
    # A value that needs no quotes gets none.
    with environment(PGPASSWORD="simple-secret"):
        assert expand_dsn("host=db password=${PGPASSWORD}") == "host=db password=simple-secret"


def test_expansion_of_other_positions_and_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "postgres:\n"
        "  dsn: \"host=${PGHOST} dbname=app${SUFFIX} password=pre${PGPASSWORD}post\\\\ x\"\n"
        "kafka:\n"
        "  bootstrap_servers: ${BROKERS}\n"
        "  producer: {sasl.password: \"${PGPASSWORD}\"}\n",
        encoding="utf-8",
    )
    secret = "a 'b' \\c"
    with environment(PGHOST="db.example.com", SUFFIX="_1", PGPASSWORD=secret, BROKERS="k1:9092,k2:9092"):
        config = load_config(path)
    assert psycopg2.extensions.parse_dsn(config.postgres.dsn.get_secret_value()) == {
        "host": "db.example.com",
        "dbname": "app_1",
        "password": f"pre{secret}post x",  # "\ " in the file is an escaped blank, as libpq reads it
    }
    # Other fields keep plain substitution.
    assert config.kafka.bootstrap_servers == "k1:9092,k2:9092"
    assert reveal(config.kafka.producer)["sasl.password"] == secret  # held as a SecretStr


@pytest.mark.parametrize(
    "value",
    ["host=db user=cdc password='a b'", "postgresql://cdc:a%20b@db/app"],
)
def test_a_whole_dsn_from_one_variable_is_inserted_as_it_is(tmp_path: Path, value: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("postgres: {dsn: '${DATABASE_URL}'}\nkafka: {bootstrap_servers: k}\n")
    with environment(DATABASE_URL=value):
        assert load_config(path).postgres.dsn.get_secret_value() == value


def test_an_unset_variable_in_the_dsn_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("postgres: {dsn: 'host=db password=${CDCD_TEST_UNSET}'}\nkafka: {bootstrap_servers: k}\n")
    os.environ.pop("CDCD_TEST_UNSET", None)
    with pytest.raises(ConfigError, match="CDCD_TEST_UNSET is not set"):
        load_config(path)


# ---------------------------------------------------------------------------- redaction

KEYWORDS = ["host", "password", "sslpassword", "user", "dbname", "application_name", "PASSWORD"]


@st.composite
def keyword_dsns(draw: st.DrawFn) -> str:
    """Keyword/value text, mostly well-formed: quoted, escaped, blank-padded and raw values."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        keyword = draw(st.sampled_from(KEYWORDS))
        sep = draw(st.sampled_from(["=", " = ", "=\t", " ="]))
        value = draw(secrets_text)
        style = draw(st.sampled_from(["quoted", "escaped", "raw"]))
        if style == "quoted":
            value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        elif style == "escaped":
            value = "".join("\\" + c if c in " \t\n\r\v\f\\'" else c for c in value)
        parts.append(f"{keyword}{sep}{value}")
    return draw(st.sampled_from([" ", "  ", "\n"])).join(parts)


def _values(dsn: str) -> list[tuple[str, str]]:
    return [(v.keyword, v.value) for v in parse_keyword_dsn(dsn)]


@settings(max_examples=400, deadline=None)
@given(dsn=st.one_of(keyword_dsns(), st.text(st.sampled_from(list(SPECIAL + "apswordhost")))))
@example(dsn="host=db password=my tail-secret")
@example(dsn="password='unterminated secret")
@example(dsn="host='x password=secret")
@example(dsn="password = 'a b\\' c' user=x")
def test_redaction_masks_every_password_value_libpq_would_read(dsn: str) -> None:
    redacted = redact_dsn(dsn)
    try:
        libpq: dict[str, str] | None = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.ProgrammingError:
        libpq = None
    try:
        values = _values(dsn)
    except DsnSyntaxError:
        assert libpq is None, "libpq parsed what the tokenizer rejected"
        start = dsn.lower().find("password")
        if start >= 0:
            # Nothing after the first "password" (and its "=") survives.
            end = start + len("password")
            assert redacted.startswith(dsn[:end])
            assert re.fullmatch(r"[ \t\n\r\v\f]*(=[ \t\n\r\v\f]*)?\*\*\*", redacted[end:]), redacted
        else:
            assert redacted == dsn
        return
    # The tokenizer reads exactly what libpq reads (last value wins in libpq).
    if libpq is not None:
        assert {k: v for k, v in values} == libpq
    masked = _values(redacted)
    assert [k for k, _ in masked] == [k for k, _ in values]
    for (keyword, value), (_, shown) in zip(values, masked, strict=True):
        assert shown == ("***" if "password" in keyword.lower() else value)


@settings(max_examples=400, deadline=None)
@given(rest=st.text(st.sampled_from(list("u:pw@h/d?&=%2#+ Zq3password")), max_size=40))
@example(rest="u:a@b@h/d?password=x%26y&password=Zq3&3")
def test_uri_redaction_masks_every_password_libpq_would_read(rest: str) -> None:
    dsn = "postgresql://" + rest
    try:
        parsed = psycopg2.extensions.parse_dsn(dsn)
    except (psycopg2.ProgrammingError, UnicodeDecodeError):
        return  # libpq rejects it: no connection, and keyword tests cover the fallback
    password = parsed.get("password")
    others = [value for key, value in parsed.items() if key != "password"]
    if password and len(password) >= 3 and not any(password in value for value in others):
        redacted = redact_dsn(dsn)
        assert password not in redacted and password not in unquote(redacted), (dsn, redacted)


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://u:p%40ss@h/db", "postgresql://u:***@h/db"),
        ("postgres://u:pa/ss@host/db", "postgres://u:***@host/db"),  # raw "/" in the password
        ("postgresql://u:a@b@host", "postgresql://u:***@host"),  # raw "@" in the password
        ("postgresql://h/db?sslmode=disable&password=x%26y", "postgresql://h/db?sslmode=disable&password=***"),
        ("postgresql://h/db?password=a&b&sslmode=disable", "postgresql://h/db?password=***&sslmode=disable"),
        ("postgresql://h/db?pass%77ord=s3cret", "postgresql://h/db?pass%77ord=***"),
        ("postgresql://h/db?sslpassword=s3cret", "postgresql://h/db?sslpassword=***"),
        ("POSTGRESQL://u:s3cret@h", "POSTGRESQL://u:***@h"),
        ("postgresql://u@h:5432/db", "postgresql://u@h:5432/db"),
    ],
)
def test_uri_redaction(dsn: str, expected: str) -> None:
    assert redact_dsn(dsn) == expected


def test_libpq_error_messages_lose_the_pieces_of_a_password() -> None:
    dsn = "host=db password=my tail-secret"
    with pytest.raises(psycopg2.ProgrammingError) as raised:
        psycopg2.extensions.parse_dsn(dsn)
    assert "tail-secret" in str(raised.value)  # libpq quotes the piece it choked on
    masked = redact_dsn_message(str(raised.value), dsn)
    assert "tail-secret" not in masked and "***" in masked
    assert redact_dsn_message('invalid value "db" for "host"', dsn) == 'invalid value "db" for "host"'


# ---------------------------------------------------------------------------- redacted()

#: Every secret holds "Zebra", which nothing else in the configuration does.
PRODUCER_SECRETS = {
    "sasl.password": "Zebra1",
    "ssl.key.password": "Zebra2 x",
    "ssl.keystore.password": "Zebra3",
    "sasl.oauthbearer.client.secret": "Zebra4",
    "sasl.oauthbearer.config": "principal=x clientSecret=Zebra5",
    "ssl.key.pem": "-----BEGIN PRIVATE KEY-----Zebra6",
}


def _full_config() -> CdcdConfig:
    return parse_config(
        {
            "postgres": {"dsn": "host=db user=cdc password='Zebra7 \\'q'"},
            "kafka": {
                "bootstrap_servers": "k:9092",
                "producer": {**PRODUCER_SECRETS, "sasl.username": "alice", "security.protocol": "SASL_SSL"},
            },
            "schema_registry": {
                "url": "https://reg-user:Zebra/8@x@registry:8081",
                "config": {"basic.auth.user.info": "bob:Zebra9", "bearer.auth.token": "Zebra10"},
            },
        }
    )


def test_redacted_masks_every_secret_and_keeps_the_rest() -> None:
    redacted = _full_config().redacted()
    text = json.dumps(redacted)
    assert "ebra" not in text, text
    assert redacted["postgres"]["dsn"] == "host=db user=cdc password=***"
    assert redacted["kafka"]["producer"]["sasl.username"] == "alice"
    assert redacted["kafka"]["producer"]["security.protocol"] == "SASL_SSL"
    assert set(redacted["kafka"]["producer"]) >= set(PRODUCER_SECRETS)
    assert all(redacted["kafka"]["producer"][k] == "***" for k in PRODUCER_SECRETS)
    assert redacted["schema_registry"]["url"] == "https://***@registry:8081"


def test_run_logs_the_redacted_configuration_once(tmp_path: Path) -> None:
    """One INFO line at startup with the JSON of ``redacted()``; here run then stops at the
    metrics address, which another socket holds, before connecting anywhere."""
    secret = "my tail-secret 'q' \\ = @"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({
            "postgres": {"dsn": "host=127.0.0.1 user=cdc password=${PGPASSWORD}"},
            "kafka": {"bootstrap_servers": "127.0.0.1:1",
                      "producer": {"sasl.password": "${PGPASSWORD}", "sasl.username": "alice"}},
            "metrics": {"listen": f"127.0.0.1:{port}"},
        }))
        result = run_cdcd("run", "-c", str(path), env={"PGPASSWORD": secret})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if " INFO cdcd.cli configuration " in line]
    assert len(lines) == 1, result.stderr
    logged = json.loads(lines[0].split(" configuration ", 1)[1])
    assert logged["postgres"]["dsn"] == "host=127.0.0.1 user=cdc password=***"
    assert logged["kafka"]["producer"] == {"sasl.password": "***", "sasl.username": "alice"}
    assert logged["metrics"]["listen"] == f"127.0.0.1:{port}"
    for piece in ("tail-secret", "my tail", "'q'"):
        assert piece not in result.stderr + result.stdout


# ---------------------------------------------------------------------------- a real server

#: Space, quote, "=", backslash, and what a URI must encode; the words are the pieces
#: that must never be printed. The variable is not PGPASSWORD, which libpq would
#: read by itself: only the DSN can carry the password to the server.
PASSWORD = "Sesame0 wörd'=x\\Yak@:/%#&?tail"
PIECES = ["Sesame", "wörd", "Yak", "tail", "'=x", "%#&", "esame0 w"]
VAR = "CDCD_TEST_SECRET"


@pytest.fixture
def scram_cluster(make_pg_cluster: Any) -> Any:
    """A private cluster where role ``pwuser`` must authenticate with PASSWORD over TCP."""
    cluster = make_pg_cluster()
    cluster.execute("CREATE ROLE pwuser LOGIN REPLICATION SUPERUSER PASSWORD %s", (PASSWORD,))
    hba = cluster.datadir / "pg_hba.conf"
    rules = (
        "host all pwuser 127.0.0.1/32 scram-sha-256\n"
        "host replication pwuser 127.0.0.1/32 scram-sha-256\n"
    )
    hba.write_text(rules + hba.read_text(encoding="utf-8"), encoding="utf-8")
    cluster.reload()
    # The server really checks the password now (the rest of the file is trust).
    with pytest.raises(psycopg2.OperationalError, match="password authentication failed"):
        psycopg2.connect(cluster.dsn(user="pwuser", password="wrong"))
    psycopg2.connect(cluster.dsn(user="pwuser", password=PASSWORD)).close()
    return cluster


def _templates(cluster: Any) -> list[str]:
    return [
        f"host=127.0.0.1 port={cluster.port} dbname=postgres user=pwuser password=${{{VAR}}}",
        f"postgresql://pwuser:${{{VAR}}}@127.0.0.1:{cluster.port}/postgres",
    ]


def _config(path: Path, dsn: str, broker: Any, **postgres: Any) -> Path:
    path.write_text(yaml.safe_dump({
        "postgres": {"dsn": dsn, "status_interval_s": 1, **postgres},
        "kafka": {"bootstrap_servers": broker.bootstrap_servers, "topic_prefix": "secrets"},
        "snapshot": {"mode": "never"},
        "metrics": {"listen": "127.0.0.1:0"},
        "heartbeat": {"interval_s": 0},
    }), encoding="utf-8")
    return path


def _assert_no_piece(output: str) -> None:
    for piece in PIECES:
        assert piece not in output, (piece, output)


@pytest.mark.integration
def test_check_and_run_authenticate_with_the_password_and_never_print_it(
    scram_cluster: Any, broker: Any, tmp_path: Path
) -> None:
    cluster = scram_cluster
    cluster.execute("CREATE TABLE items(id int PRIMARY KEY)", dbname="postgres")
    for index, template in enumerate(_templates(cluster)):
        config = _config(tmp_path / f"c{index}.yaml", template, broker, tables=["public.items"],
                         slot=f"secrets{index}", publication=f"secrets{index}")
        check = run_cdcd("check", "-c", str(config), env={VAR: PASSWORD})
        output = check.stdout + check.stderr
        # Connected: the password reached the server intact.
        assert any(line.startswith("ok   postgres: connected") for line in check.stdout.splitlines()), output
        assert "password=***" in output or "pwuser:***@" in output, output
        _assert_no_piece(output)

        # run: the startup configuration line, streaming, and a clean stop print nothing of it.
        daemon = DaemonProcess(config, tmp_path / f"run{index}.log", env={VAR: PASSWORD})
        try:
            wait_streaming(cluster, f"secrets{index}", daemon)
            assert daemon.terminate() == 0, daemon.log()
        finally:
            if daemon.alive():
                daemon.kill9()
        assert " configuration {" in daemon.log()
        _assert_no_piece(daemon.log())


@pytest.mark.integration
def test_a_refused_password_is_exit_3_and_not_printed(
    scram_cluster: Any, broker: Any, tmp_path: Path
) -> None:
    wrong = PASSWORD.replace("Sesame0", "Sesame1")  # refused; its pieces must not print either
    for index, template in enumerate(_templates(scram_cluster)):
        config = _config(tmp_path / f"c{index}.yaml", template, broker)
        run = run_cdcd("run", "-c", str(config), env={VAR: wrong})
        assert run.returncode == 3, run.stderr
        assert "password authentication failed" in run.stderr, run.stderr
        check = run_cdcd("check", "-c", str(config), env={VAR: wrong})
        assert "FAIL postgres" in check.stdout, check.stdout
        for output in (run.stdout + run.stderr, check.stdout + check.stderr):
            _assert_no_piece(output)
