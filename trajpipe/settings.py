"""Shared settings: command-line flags > ``TRAJPIPE_*`` environment > config file > defaults.

The config file is YAML (or TOML), named by ``--config`` or ``TRAJPIPE_CONFIG``::

    # trajpipe.yaml
    kafka:
      bootstrap_servers: broker-1:9093,broker-2:9093
      security_protocol: SASL_SSL
      sasl_mechanism: SCRAM-SHA-512
      sasl_username: rl-pipeline
      sasl_password_file: /run/secrets/kafka-password   # or TRAJPIPE_SASL_PASSWORD in the environment
      ssl_cafile: /etc/kafka/ca.pem
      connect_timeout_s: 30   # how long a command waits for the broker before `error: cannot reach Kafka ...`
    topics:
      partitions: 12

Environment variables use ``__`` between levels, e.g.
``TRAJPIPE_KAFKA__BOOTSTRAP_SERVERS=broker:9092`` or ``TRAJPIPE_TOPICS__PARTITIONS=8``;
the common ones also have short forms: ``TRAJPIPE_BOOTSTRAP``, ``TRAJPIPE_SASL_PASSWORD``.

The SASL password comes from a file (``kafka.sasl_password_file``) or the environment
(``TRAJPIPE_SASL_PASSWORD`` / ``TRAJPIPE_KAFKA__SASL_PASSWORD``), never from a flag, so it
is not in ``ps`` output or shell history; it is a ``SecretStr`` (``**********`` when the
settings are printed or dumped) and ``KafkaConnection`` hides it from ``repr()``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from streams.config import ConfigError, KafkaConnection, Topics
from trainer.config import describe_validation_error

__all__ = ["KafkaSettings", "TopicSettings", "Settings", "load_settings"]


class KafkaSettings(BaseModel):
    """Kafka cluster connection (see :class:`streams.config.KafkaConnection` for each field)."""

    bootstrap_servers: str = Field("127.0.0.1:9092", description="comma-separated host:port list")
    client_id: str = Field("trajpipe", description="client id reported to the broker")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = Field(None, description="PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
    sasl_username: str | None = None
    sasl_password: SecretStr | None = Field(None, description="SASL password (env or config file only)")
    sasl_password_file: str | None = Field(None, description="file whose first line is the SASL password")
    connect_timeout_s: float = Field(30.0, description="seconds to wait for a broker to accept a client")
    ssl_cafile: str | None = Field(None, description="CA bundle (PEM)")
    ssl_certfile: str | None = Field(None, description="client certificate (PEM)")
    ssl_keyfile: str | None = Field(None, description="client key (PEM)")


class TopicSettings(BaseModel):
    """Topic names and partition counts."""

    events: str = "trajpipe.events"
    dead_letters: str = "trajpipe.dead-letters"
    control: str = "trajpipe.control"
    partitions: int = Field(4, description="partitions of the events topic")
    replication_factor: int = 1


class Settings(BaseSettings):
    """All settings an entry point may need."""

    model_config = SettingsConfigDict(env_prefix="TRAJPIPE_", env_nested_delimiter="__", extra="ignore")

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    topics: TopicSettings = Field(default_factory=TopicSettings)
    broker_dir: str = Field(".trajpipe/broker", description="data dir of the embedded broker")
    spool_dir: str = Field(".trajpipe/spool", description="producer spool (events kept while Kafka is unreachable)")

    _spool_configured: bool = PrivateAttr(False)

    @property
    def spool_configured(self) -> bool:
        """Whether ``spool_dir`` was set explicitly (flag, ``TRAJPIPE_SPOOL_DIR`` or config file).

        Producing commands spool at start, when the broker cannot be reached, only then;
        otherwise they fail with :class:`streams.errors.KafkaUnavailable`.
        """
        return self._spool_configured

    def connection(self, *, client_id: str | None = None) -> KafkaConnection:
        """The typed connection object components take (the password read from its file).

        Raises:
            ConfigError: ``sasl_password_file`` cannot be read, or is given with ``sasl_password``.
        """
        data = self.kafka.model_dump()
        password_file = data.pop("sasl_password_file")
        secret = self.kafka.sasl_password
        data["sasl_password"] = secret.get_secret_value() if secret is not None else None
        if password_file:
            if secret is not None:
                raise ConfigError("both kafka.sasl_password and kafka.sasl_password_file are set; keep one "
                                  "(unset TRAJPIPE_SASL_PASSWORD / TRAJPIPE_KAFKA__SASL_PASSWORD, or the file setting)")
            try:
                data["sasl_password"] = Path(password_file).expanduser().read_text().splitlines()[0]
            except (OSError, IndexError) as err:
                raise ConfigError(f"kafka.sasl_password_file {password_file} cannot be read ({err}); point "
                                  "TRAJPIPE_KAFKA__SASL_PASSWORD_FILE (or the config file) at a readable file "
                                  "holding the password") from None
        if client_id:
            data["client_id"] = client_id
        return KafkaConnection(**data)

    def topic_names(self) -> Topics:
        """The typed topics object components take."""
        return Topics(**self.topics.model_dump())


#: libyaml's safe loader where PyYAML has it: ~100x faster, and it stops at a nesting depth limit instead of
#: recursing (the pure-Python loader takes seconds to hit the recursion limit on a deeply nested document).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist (from --config or TRAJPIPE_CONFIG)")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:  # a directory, no permission, ...
        raise ConfigError(f"config file {path} (--config or TRAJPIPE_CONFIG) cannot be read: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} (--config or TRAJPIPE_CONFIG) is not UTF-8 text ({err}); "
                          "give a YAML or TOML file") from err
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.load(text, Loader=_YAML_LOADER)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"config file {path} (--config or TRAJPIPE_CONFIG) is not valid YAML/TOML: {err}") from err
    except RecursionError:  # both parsers recurse once per level of nesting
        raise ConfigError(f"config file {path} (--config or TRAJPIPE_CONFIG) nests lists or mappings thousands of "
                          "levels deep; settings are two levels (section: key: value)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} (--config or TRAJPIPE_CONFIG) holds a {type(data).__name__}; it must "
                          "hold a mapping of sections (kafka:, topics:, ...) at the top level")
    return data


def load_settings(config: str | None = None, **overrides: Any) -> Settings:
    """Build settings from the config file, the environment and explicit overrides.

    Args:
        config: config file path; defaults to ``$TRAJPIPE_CONFIG`` if set.
        **overrides: flag values; ``None`` means "not given". Keys: ``bootstrap``
            and any :class:`KafkaSettings` field, ``partitions``.

    Raises:
        ConfigError: unreadable config file or invalid values.
    """
    config = config or os.environ.get("TRAJPIPE_CONFIG")
    file_data = _read_file(Path(config)) if config else {}
    try:
        settings = Settings()  # environment and defaults
    except ValidationError as err:
        raise ConfigError(f"invalid TRAJPIPE_* environment: {_describe(err)}") from err
    except ValueError as err:  # pydantic-settings' SettingsError: a nested value that is not JSON
        raise ConfigError(f"invalid TRAJPIPE_* environment: {err}; nested settings take JSON "
                          "(TRAJPIPE_KAFKA='{\"bootstrap_servers\": \"host:9092\"}') or one variable per field "
                          "(TRAJPIPE_KAFKA__BOOTSTRAP_SERVERS=host:9092)") from err
    merged = settings.model_dump()
    # File values apply where the environment did not set anything explicit.
    env_set = {k.lower() for k in os.environ if k.startswith("TRAJPIPE_")}
    for section, values in file_data.items():
        if isinstance(merged.get(section), dict) and not isinstance(values, dict):
            raise ConfigError(f"config file {config}: `{section}` must be a mapping of settings ({section}: "
                              f"{{key: value, ...}}), got {values!r:.60}")
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            for key, value in values.items():
                if f"trajpipe_{section}__{key}".lower() not in env_set:
                    merged[section][key] = value
        elif f"trajpipe_{section}".lower() not in env_set:
            merged[section] = values
    short = {"TRAJPIPE_BOOTSTRAP": "bootstrap_servers", "TRAJPIPE_SASL_PASSWORD": "sasl_password"}
    for env, key in short.items():
        if os.environ.get(env):
            merged["kafka"][key] = os.environ[env]
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "bootstrap":
            merged["kafka"]["bootstrap_servers"] = value
        elif key in KafkaSettings.model_fields:
            merged["kafka"][key] = value
        elif key in TopicSettings.model_fields:
            merged["topics"][key] = value
        else:
            merged[key] = value
    spool_explicit = (overrides.get("spool_dir") is not None or "spool_dir" in file_data
                      or bool(os.environ.get("TRAJPIPE_SPOOL_DIR")))
    for key in ("sasl_password",):  # model_dump() turned the secret into a mask; keep the value
        secret = merged["kafka"].get(key)
        if isinstance(secret, SecretStr):
            merged["kafka"][key] = secret.get_secret_value()
    try:
        result = Settings.model_validate(merged)
        result._spool_configured = spool_explicit
        result.connection()
        result.topic_names()
    except ConfigError:
        raise
    except ValidationError as err:
        raise ConfigError(f"invalid settings: {_describe(err)}") from err
    except ValueError as err:
        raise ConfigError(f"invalid settings: {err}") from err
    return result


def _describe(err: ValidationError) -> str:
    """Each problem on one line: the setting, where it can come from, what is wrong, the value given."""
    return describe_validation_error(
        err, see="see the settings in trajpipe/settings.py's docstring and docs/broker.md",
        sources=lambda key: f"config file key, or TRAJPIPE_{key.replace('.', '__').upper()}")
