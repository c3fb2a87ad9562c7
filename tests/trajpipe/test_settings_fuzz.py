"""Fuzz target ``fuzz_settings``: the settings loader (config file YAML/TOML + ``TRAJPIPE_*`` environment + flags).

Inputs start from a valid config file and environment and mutate them: values of other types and sizes,
unknown and missing keys, sections that are not mappings, YAML/TOML text with bytes flipped, cut or not UTF-8,
nesting thousands deep, YAML tags and aliases; environment variables with malformed values; flag overrides.
Property: :func:`trajpipe.settings.load_settings` returns settings whose connection and topics build, or raises
:class:`streams.config.ConfigError` (one line at the command line); nothing else.
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from streams.config import ConfigError
from tests import fuzzing
from trajpipe.settings import Settings, load_settings

pytestmark = pytest.mark.fuzz

VALID = {
    "kafka": {"bootstrap_servers": "broker-1:9093,broker-2:9093", "security_protocol": "SASL_SSL",
              "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "rl", "ssl_cafile": "/etc/ca.pem"},
    "topics": {"events": "ev", "partitions": 12, "replication_factor": 1},
    "broker_dir": ".trajpipe/broker",
    "spool_dir": ".trajpipe/spool",
}
VALID_TOML = """broker_dir = ".trajpipe/broker"
[kafka]
bootstrap_servers = "broker-1:9093"
security_protocol = "PLAINTEXT"
[topics]
partitions = 4
"""
ENV_NAMES = ["TRAJPIPE_BOOTSTRAP", "TRAJPIPE_SASL_PASSWORD", "TRAJPIPE_KAFKA__BOOTSTRAP_SERVERS",
             "TRAJPIPE_KAFKA__SECURITY_PROTOCOL", "TRAJPIPE_TOPICS__PARTITIONS", "TRAJPIPE_TOPICS__EVENTS",
             "TRAJPIPE_KAFKA", "TRAJPIPE_TOPICS", "TRAJPIPE_SPOOL_DIR", "TRAJPIPE_BROKER_DIR", "TRAJPIPE_NOPE"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=30),
    st.sampled_from(["", "host", "host:", ":9092", "h:1,,h:2", "SASL_SSL", "PLAINTEXT", "0", "-1", "1e3", "[1, 2]",
                     '{"bootstrap_servers": "h:1"}', "null", "true"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
env_values = st.one_of(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                               max_size=40), st.sampled_from(["h:1", "9", "x", "{", "[]", '{"partitions": "x"}',
                                                              '{"bootstrap_servers": 5}', "SASL_SSL"]))


@contextmanager
def _environment(env: dict[str, str]):
    """Exactly these TRAJPIPE_* variables for the block (the fuzzer's own, restored after each example)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("TRAJPIPE_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("TRAJPIPE_")]:
            del os.environ[k]
        os.environ.update(saved)


@st.composite
def config_files(draw) -> tuple[str, bytes]:
    """(suffix, content) of a config file: a mutated valid document, or mutated text."""
    kind = draw(st.sampled_from(["value", "drop", "extra", "section", "text", "toml", "deep", "yaml_tricks"]))
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in VALID.items()}
    if kind in ("value", "drop"):
        section = draw(st.sampled_from(sorted(doc)))
        if isinstance(doc[section], dict):
            key = draw(st.sampled_from(sorted(doc[section]) + ["client_id", "sasl_password", "dead_letters"]))
            if kind == "value":
                doc[section][key] = draw(values)
            else:
                doc[section].pop(key, None)
        elif kind == "value":
            doc[section] = draw(values)
        else:
            del doc[section]
    elif kind == "extra":
        doc[draw(st.text(max_size=10))] = draw(values)
    elif kind == "section":  # a section that is not a mapping, or a top level that is not one
        if draw(st.booleans()):
            doc[draw(st.sampled_from(["kafka", "topics"]))] = draw(values)
        else:
            doc = draw(values)
    if kind in ("value", "drop", "extra", "section"):
        return ".yaml", yaml.safe_dump(doc, allow_unicode=True).encode()
    if kind == "deep":  # nesting deeper than the parsers' recursion
        depth = draw(st.sampled_from([100, 2_000, 50_000]))
        if draw(st.booleans()):
            return ".yaml", b"kafka: " + b"[" * depth + b"]" * depth + b"\n"
        return ".toml", b"a = " + b"[" * depth + b"]" * depth + b"\n"
    if kind == "yaml_tricks":
        return ".yaml", draw(st.sampled_from([
            b"kafka: !!python/object/apply:os.system ['true']\n",
            b"a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nkafka: &d [*c, *c, *c, *c]\n",
            b"topics:\n  partitions: &p 3\n  replication_factor: *p\n",
            b"kafka: {bootstrap_servers: h:1}\nkafka: {bootstrap_servers: h:2}\n",
            b"\xff\xfe\x00k\x00a\x00", b"---\n---\n", b"", b"\t- bad indent",
        ]))
    text = yaml.safe_dump(VALID).encode() if kind == "text" else VALID_TOML.encode()
    mutation = draw(st.sampled_from(["flip", "truncate", "insert"]))
    buf = bytearray(text)
    if mutation == "flip":
        for pos in draw(st.lists(st.integers(0, len(buf) * 8 - 1), min_size=1, max_size=4)):
            buf[pos // 8] ^= 1 << (pos % 8)
    elif mutation == "truncate":
        del buf[draw(st.integers(0, len(buf) - 1)):]
    else:
        at = draw(st.integers(0, len(buf)))
        buf[at:at] = draw(st.binary(min_size=1, max_size=8))
    return (".toml" if kind == "toml" else ".yaml"), bytes(buf)


def _check(config: str | None, env: dict[str, str], overrides: dict) -> None:
    with _environment(env):
        try:
            settings = load_settings(config, **overrides)
        except ConfigError as err:
            assert str(err)
            return
    assert isinstance(settings, Settings)
    settings.connection(client_id="fuzz")  # the typed objects components take build without error
    settings.topic_names()


@given(config=config_files(), env=st.dictionaries(st.sampled_from(ENV_NAMES), env_values, max_size=3),
       bootstrap=st.one_of(st.none(), st.sampled_from(["h:1", "bad", "", "a:1,b:x"])),
       partitions=st.one_of(st.none(), st.integers(-3, 3)))
def test_load_settings_returns_settings_or_raises_config_error(config, env, bootstrap, partitions, scratch):
    fuzzing.tried("fuzz_settings")
    suffix, content = config
    path = scratch / f"{uuid.uuid4().hex}{suffix}"
    path.write_bytes(content)
    with fuzzing.python_memory_bound(64 << 20):
        _check(str(path), env, {"bootstrap": bootstrap, "partitions": partitions})
    path.unlink()


@given(env=st.dictionaries(st.sampled_from(ENV_NAMES), env_values, min_size=1, max_size=4),
       where=st.sampled_from(["none", "missing", "directory"]))
def test_environment_and_config_paths_give_settings_or_config_error(env, where, scratch):
    fuzzing.tried("fuzz_settings")
    config = {"none": None, "missing": str(scratch / "missing.yaml"), "directory": str(scratch)}[where]
    _check(config, env, {})


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("settings-fuzz")
