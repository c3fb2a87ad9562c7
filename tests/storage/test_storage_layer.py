"""schemas.storage without a server: which filesystem a location gets, the settings read, what is never shown."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from schemas.storage import (
    RemoteStorageNotSupported,
    S3Settings,
    StorageError,
    delta_storage_options,
    local_path,
    resolve,
    scheme_of,
)

SECRET = "s3cr3t-never-shown-0123456789"
ENV = {"AWS_ENDPOINT_URL": "http://127.0.0.1:8333", "AWS_ACCESS_KEY_ID": "AKTEST",
       "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": f"token-{SECRET}", "AWS_REGION": "eu-west-1"}


def test_local_paths_and_file_uris_resolve_to_the_local_filesystem(tmp_path):
    for location in (tmp_path / "d", str(tmp_path / "d"), f"file://{tmp_path}/d", f"file://localhost{tmp_path}/d"):
        fs, path = resolve(location)
        assert isinstance(fs, pafs.LocalFileSystem) and path == f"{tmp_path}/d"
    fs, path = resolve("relative/dir")
    assert path == str(Path.cwd() / "relative" / "dir")


def test_s3_uris_resolve_to_an_s3_filesystem_configured_from_the_aws_variables():
    fs, path = resolve("s3://bucket/datasets/steps/", environ=ENV)
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/datasets/steps"
    assert fs.region == "eu-west-1"
    state = fs.__reduce__()[1][0]  # what pyarrow will use: endpoint, keys
    assert state["endpoint_override"] == "http://127.0.0.1:8333"
    assert state["access_key"] == "AKTEST" and state["secret_key"] == SECRET


def test_the_specific_endpoint_and_region_variables_win_and_defaults_apply():
    s = S3Settings.from_env({"AWS_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "https://b:2",
                             "AWS_DEFAULT_REGION": "ap-south-1"})
    assert (s.endpoint, s.region, s.allow_http, s.access_key) == ("https://b:2", "ap-south-1", False, None)
    assert S3Settings.from_env({}) == S3Settings(endpoint=None, region="us-east-1")


@pytest.mark.parametrize("location,message", [
    ("gs://bucket/x", "scheme gs:// is not supported"),
    ("az://container/x", "scheme az:// is not supported"),
    ("s3:///no-bucket", "names no bucket"),
    ("file://otherhost/x", "must be local"),
])
def test_unusable_locations_are_refused_naming_the_problem(location, message):
    with pytest.raises(StorageError, match=message):
        resolve(location, environ=ENV)
    with pytest.raises(StorageError, match=message):
        delta_storage_options(location, environ=ENV)


def test_an_endpoint_without_http_scheme_is_refused():
    with pytest.raises(StorageError, match="must start with http:// or https://"):
        S3Settings.from_env({"AWS_ENDPOINT_URL": "127.0.0.1:8333"})


def test_delta_options_name_the_endpoint_and_the_conditional_put_and_no_credentials():
    # delta-rs reads the keys from the environment itself; the options carry no secret and no unsafe rename.
    assert delta_storage_options("s3://bucket/t", environ=ENV) == {
        "AWS_REGION": "eu-west-1", "conditional_put": "etag", "AWS_ENDPOINT_URL": "http://127.0.0.1:8333",
        "AWS_ALLOW_HTTP": "true"}
    assert delta_storage_options("s3://bucket/t", environ={"AWS_REGION": "us-west-2"}) == {
        "AWS_REGION": "us-west-2", "conditional_put": "etag"}  # AWS S3 itself: https, default endpoint
    assert delta_storage_options("/tmp/t") == {} and delta_storage_options("file:///tmp/t") == {}


def test_the_secret_is_in_no_repr_str_or_log_line(caplog):
    settings = S3Settings.from_env(ENV)
    fs, _ = resolve("s3://bucket/x", environ=ENV)
    options = delta_storage_options("s3://bucket/x", environ=ENV)
    with caplog.at_level(logging.INFO):
        logging.getLogger("trajpipe.test").info("storage: %s %r %s %s", settings, settings, options, fs)
    shown = " ".join([repr(settings), str(settings), repr(options), caplog.text])
    assert SECRET not in shown and "AKTEST" in shown  # the key id may be shown, the secret and token never


def test_local_path_refuses_remote_uris_naming_the_flag_and_maps_file_uris():
    assert local_path("file:///data/run", flag="--out") == Path("/data/run")
    assert local_path(Path("rel/dir"), flag="--out") == Path("rel/dir")
    assert scheme_of(Path("gs://bucket/x")) == "gs"  # what pathlib makes of a URI is still recognised
    with pytest.raises(RemoteStorageNotSupported) as err:
        local_path(Path("gs://bucket/datasets"), flag="--data")
    assert str(err.value).startswith("`--data` gs://bucket/datasets: remote storage is not yet supported for "
                                     "`--data`")


def test_list_files_answers_in_the_form_of_the_location_given(tmp_path, monkeypatch):
    """A relative local location lists relative paths under it (callers cut their prefix off the results).

    Before, the filesystem's absolute paths came back: the dataset commit cut ``len(staging)`` characters
    off them and ``trajpipe pipeline run --out rel/dir`` read a JSON count file as Parquet.
    """
    from schemas import locations as loc

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel" / "a" / "b").mkdir(parents=True)
    (tmp_path / "rel" / "a" / "b" / "x.parquet").write_bytes(b"x")
    (tmp_path / "rel" / "a" / "y.json").write_bytes(b"{}")
    assert loc.list_files("rel/a") == ["rel/a/b/x.parquet", "rel/a/y.json"]
    assert loc.list_files("rel/a/", suffix=".json") == ["rel/a/y.json"]
    assert loc.list_files(str(tmp_path / "rel" / "a"), suffix=".parquet") == [str(tmp_path / "rel/a/b/x.parquet")]
    assert loc.list_files("rel/none") == []
