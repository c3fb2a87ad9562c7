"""trajpipe/settings.py: what a bad config file or environment gives (found by tests/trajpipe/test_settings_fuzz.py)."""

from __future__ import annotations

import pytest

from streams.config import ConfigError
from trajpipe.settings import load_settings


@pytest.fixture(autouse=True)
def _no_trajpipe_env(monkeypatch):
    import os

    for name in [k for k in os.environ if k.startswith("TRAJPIPE_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name,content,says", [
    ("latin1.yaml", "kafka:\n  client_id: caf\xe9\n".encode("latin-1"), "is not UTF-8 text"),  # was UnicodeDecodeError
    ("deep.toml", b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nests lists or mappings"),  # was RecursionError
    ("deep.yaml", b"kafka: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nest"),  # libyaml: "maximum nesting depth"
    ("list.yaml", b"- kafka\n", "holds a list"),
    ("null.yaml", b"kafka: null\n", "`kafka` must be a mapping of settings"),  # was TypeError (with a flag set)
    ("type.yaml", b"topics:\n  partitions: many\n", "`topics.partitions` (config file key, or TRAJPIPE_TOPICS__PARTITIONS)"),
])
def test_a_bad_config_file_is_one_config_error_naming_it(tmp_path, name, content, says):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^(config file {path}|invalid settings)") as err:
        load_settings(str(path), bootstrap="h:1")
    assert says in str(err.value)


def test_a_directory_as_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):  # was IsADirectoryError
        load_settings(str(tmp_path))


def test_a_bad_environment_is_a_config_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TRAJPIPE_TOPICS__PARTITIONS", "many")  # was a pydantic ValidationError
    with pytest.raises(ConfigError, match="TRAJPIPE_TOPICS__PARTITIONS"):
        load_settings(None)
    monkeypatch.delenv("TRAJPIPE_TOPICS__PARTITIONS")
    monkeypatch.setenv("TRAJPIPE_KAFKA", "{not json")  # was pydantic-settings' SettingsError
    with pytest.raises(ConfigError, match="TRAJPIPE_KAFKA__BOOTSTRAP_SERVERS=host:9092"):
        load_settings(None)


def test_every_invalid_setting_is_named_on_one_line_by_the_trainers_describer(tmp_path):
    # trajpipe/settings.py and trainer/config.py describe pydantic errors with one function
    path = tmp_path / "two.yaml"
    path.write_bytes(b"topics:\n  partitions: many\nkafka:\n  connect_timeout_s: [1]\n")
    with pytest.raises(ConfigError) as err:
        load_settings(str(path), bootstrap="h:1")
    message = str(err.value)
    assert "\n" not in message and message.startswith("invalid settings: ")
    assert "`topics.partitions` (config file key, or TRAJPIPE_TOPICS__PARTITIONS): " in message
    assert "got 'many'" in message
    assert "`kafka.connect_timeout_s` (config file key, or TRAJPIPE_KAFKA__CONNECT_TIMEOUT_S): " in message
    assert "; " in message and "got [1]" in message
