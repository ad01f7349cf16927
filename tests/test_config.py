"""``kvdepot.config``: one table of keys, four sources, and a ConfigError for every bad input.

Most tests call ``resolve_config(args, env=...)`` with an explicit env mapping, so nothing here
depends on (or leaks into) the process environment; one test goes through ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.config import CONFIG_FILE_ENV, DepotConfig, config_keys, load_config, resolve_config
from kvdepot.errors import ConfigError


def resolve(tmp_path: Path, args: dict | None = None, env: dict | None = None, file: str | None = None):
    env = dict(env or {})
    if file is not None:
        path = tmp_path / "kvdepot.yaml"
        path.write_text(file)
        env[CONFIG_FILE_ENV] = str(path)
    return resolve_config(args or {}, env=env)


# ---- the table ---------------------------------------------------------------------------------


def test_every_key_is_documented_and_the_defaults_are_valid():
    fields = config_keys()
    assert [f.name for f in fields] == [f.name for f in dataclasses.fields(DepotConfig)]
    for f in fields:
        assert f.metadata["doc"].strip(), f.name
    config, sources = resolve_config({}, env={})
    assert config == DepotConfig()
    assert set(sources) == {f.name for f in fields}
    assert set(sources.values()) == {"default"}


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DepotConfig().chunk_size = 1  # type: ignore[misc]


# ---- bad input: one ConfigError per kind, naming the key, the value and what is allowed -------------

BAD_VALUES = [
    # (id, args, env, file, fragments the message must contain)
    ("unknown-arg", {"chunk_sise": 64}, {}, None, ["'chunk_sise'", "64", "chunk_size", "hash_algo"]),
    ("unknown-lmcache-arg", {"remote_serde": "naive"}, {}, None, ["'remote_serde'", "'naive'", "chunk_size"]),
    ("unknown-file-key", {}, {}, "chunk_sise: 64\n", ["'chunk_sise'", "64", "chunk_size", "kvdepot.yaml"]),
    ("unknown-env", {}, {"KVDEPOT_CHUNK_SISE": "64"}, None, ["'KVDEPOT_CHUNK_SISE'", "'64'", "KVDEPOT_CHUNK_SIZE"]),
    ("env-wrong-case", {}, {"KVDEPOT_chunk_size": "64"}, None, ["'KVDEPOT_chunk_size'", "KVDEPOT_CHUNK_SIZE"]),
    ("int-as-str", {"chunk_size": "128"}, {}, None, ["'chunk_size'", "'128'", "an integer >= 1"]),
    ("int-as-float", {"chunk_size": 128.0}, {}, None, ["'chunk_size'", "128.0", "an integer"]),
    ("int-as-bool", {"chunk_size": True}, {}, None, ["'chunk_size'", "True", "an integer"]),
    ("int-as-none", {"chunk_size": None}, {}, None, ["'chunk_size'", "None", "an integer"]),
    ("bool-as-str", {"save_decode_cache": "yes"}, {}, None, ["'save_decode_cache'", "'yes'", "true or false"]),
    ("bool-as-int", {"save_decode_cache": 1}, {}, None, ["'save_decode_cache'", "1", "true or false"]),
    ("float-as-str", {"host_capacity_gb": "4"}, {}, None, ["'host_capacity_gb'", "'4'", "a number >= 0"]),
    ("str-as-int", {"cache_salt": 7}, {}, None, ["'cache_salt'", "7", "a string"]),
    ("optional-str-as-int", {"disk_path": 3}, {}, None, ["'disk_path'", "3", "a string (or unset)"]),
    ("file-wrong-type", {}, {}, "chunk_size: abc\n", ["'chunk_size'", "'abc'", "an integer"]),
    ("file-alias-out-of-range", {}, {}, "max_local_cpu_size: -1\n", ["'host_capacity_gb'", "-1", ">= 0"]),
    ("zero-chunk", {"chunk_size": 0}, {}, None, ["'chunk_size'", "0", ">= 1"]),
    ("negative-capacity", {"host_capacity_gb": -0.5}, {}, None, ["'host_capacity_gb'", "-0.5", ">= 0"]),
    ("nan-capacity", {"host_capacity_gb": math.nan}, {}, None, ["'host_capacity_gb'", "nan", ">= 0"]),
    ("zero-lease", {"lease_timeout_s": 0}, {}, None, ["'lease_timeout_s'", "0", ">= 0.001"]),
    ("env-out-of-range", {}, {"KVDEPOT_CHUNK_SIZE": "-4"}, None, ["'chunk_size'", "-4", ">= 1"]),
    ("env-nan", {}, {"KVDEPOT_DISK_CAPACITY_GB": "nan"}, None, ["'disk_capacity_gb'", "nan", ">= 0"]),
    ("bad-choice-log", {"log_level": "TRACE"}, {}, None, ["'log_level'", "'TRACE'", "'DEBUG'", "'ERROR'"]),
    ("bad-choice-hash", {"hash_algo": "sha256"}, {}, None, ["'hash_algo'", "'sha256'", "'xxh3_128', 'blake3'"]),
    ("bad-choice-pin", {"pin_host_memory": "maybe"}, {}, None, ["'pin_host_memory'", "'maybe'", "'auto'"]),
    ("env-bad-choice", {}, {"KVDEPOT_LOG_LEVEL": "trace"}, None, ["'log_level'", "'trace'", "'INFO'"]),
    ("env-bad-load-by-layer", {}, {"KVDEPOT_LOAD_BY_LAYER": "on"}, None, ["'load_by_layer'", "'on'", "'auto', 'off'"]),
    ("env-bad-bool", {}, {"KVDEPOT_SAVE_DECODE_CACHE": "maybe"}, None, ["'save_decode_cache'", "'maybe'", "true or false"]),
    ("env-empty-bool", {}, {"KVDEPOT_SAVE_DECODE_CACHE": ""}, None, ["'save_decode_cache'", "''", "true or false"]),
    ("env-bad-int", {}, {"KVDEPOT_CHUNK_SIZE": "12x"}, None, ["'chunk_size'", "'12x'", "an integer"]),
    ("env-float-for-int", {}, {"KVDEPOT_CHUNK_SIZE": "1.5"}, None, ["'chunk_size'", "'1.5'", "an integer"]),
    ("env-bad-float", {}, {"KVDEPOT_HOST_CAPACITY_GB": "four"}, None, ["'host_capacity_gb'", "'four'", "a number"]),
    ("bad-yaml", {}, {}, "chunk_size: [1, 2\n", ["kvdepot.yaml", "not valid YAML"]),
    ("yaml-list", {}, {}, "- chunk_size\n- 64\n", ["kvdepot.yaml", "expected a mapping", "list"]),
    ("yaml-scalar", {}, {}, "42\n", ["kvdepot.yaml", "expected a mapping", "int"]),
]


@pytest.mark.parametrize(("args", "env", "file", "fragments"), [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_bad_input_raises_config_error_naming_key_value_and_allowed(tmp_path, args, env, file, fragments):
    args_before, env_before = dict(args), dict(env)
    with pytest.raises(ConfigError) as err:
        resolve(tmp_path, args, env, file)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert isinstance(err.value, ValueError)  # callers may catch the builtin
    assert (args, env) == (args_before, env_before)  # caller-owned mappings are never mutated


def test_missing_or_unreadable_file_raises_config_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="no such file") as err:
        resolve_config({}, env={CONFIG_FILE_ENV: str(missing)})
    assert str(missing) in str(err.value) and CONFIG_FILE_ENV in str(err.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        resolve_config({}, env={CONFIG_FILE_ENV: str(tmp_path)})  # a directory
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="binary.yaml"):
        resolve_config({}, env={CONFIG_FILE_ENV: str(binary)})


def test_constructing_the_dataclass_directly_validates_too():
    with pytest.raises(ConfigError, match="'chunk_size'"):
        DepotConfig(chunk_size=-1)
    with pytest.raises(ConfigError, match="'hash_algo'"):
        DepotConfig(hash_algo="md5")


# ---- parsing and aliases ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "value"),
    [("1", True), ("true", True), ("YES", True), (" On ", True), ("0", False), ("False", False), ("no", False), ("off", False)],
)
def test_env_bool_strings(raw, value):
    config, sources = resolve_config({}, env={"KVDEPOT_SAVE_DECODE_CACHE": raw})
    assert config.save_decode_cache is value
    assert sources["save_decode_cache"] == "env KVDEPOT_SAVE_DECODE_CACHE"


def test_env_numbers_strings_and_unset():
    env = {
        "KVDEPOT_CHUNK_SIZE": " 64 ",
        "KVDEPOT_HOST_CAPACITY_GB": "2.5",
        "KVDEPOT_LEASE_TIMEOUT_S": "1e-3",
        "KVDEPOT_CACHE_SALT": "tenant-a",
        "KVDEPOT_DISK_PATH": "",  # an empty optional key means unset
        "KVDEPOT_HASH_ALGO": "xxh3_128",
        "UNRELATED": "ignored",
    }
    config, _ = resolve_config({}, env=env)
    assert (config.chunk_size, config.host_capacity_gb, config.lease_timeout_s) == (64, 2.5, 0.001)
    assert (config.cache_salt, config.disk_path, config.hash_algo) == ("tenant-a", None, "xxh3_128")


def test_lmcache_config_file_loads_with_aliases(tmp_path, caplog):
    text = (
        "chunk_size: 128\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 2.5\n"
        'local_disk: "file:///var/cache/kv/"\n'
        "max_local_disk_size: 40\n"
        'remote_url: "redis://cache:6379"\n'
        "remote_serde: naive\n"
        "save_decode_cache: true\n"
    )
    with caplog.at_level(logging.WARNING, logger="kvdepot"):
        config, sources = resolve(tmp_path, file=text)
    assert config.chunk_size == 128
    assert config.host_capacity_gb == 2.5
    assert config.disk_path == "/var/cache/kv/"
    assert config.disk_capacity_gb == 40
    assert config.remote_url == "redis://cache:6379"
    assert config.save_decode_cache is True
    file_source = f"file {tmp_path / 'kvdepot.yaml'}"
    for name in ("chunk_size", "host_capacity_gb", "disk_path", "disk_capacity_gb", "remote_url", "save_decode_cache"):
        assert sources[name] == file_source
    warned = caplog.text
    assert "local_cpu" in warned and "remote_serde" in warned


def test_lmcache_aliases_as_arguments():
    args = {"max_local_cpu_size": 1.5, "local_disk": "file:///tmp/kv", "max_local_disk_size": 3, "remote_url": "redis://r"}
    config, sources = resolve_config(args, env={})
    assert (config.host_capacity_gb, config.disk_path, config.disk_capacity_gb) == (1.5, "/tmp/kv", 3)
    assert config.remote_url == "redis://r"
    assert {sources[k] for k in ("host_capacity_gb", "disk_path", "disk_capacity_gb", "remote_url")} == {"argument"}
    # A plain path is kept as it is; only LMCache's file:// form is rewritten.
    assert resolve_config({"local_disk": "/plain"}, env={})[0].disk_path == "/plain"
    assert resolve_config({"disk_path": "file:///kept"}, env={})[0].disk_path == "file:///kept"


def test_empty_file_and_empty_file_variable_mean_defaults(tmp_path):
    config, sources = resolve(tmp_path, file="")
    assert config == DepotConfig() and set(sources.values()) == {"default"}
    config, sources = resolve_config({}, env={CONFIG_FILE_ENV: ""})
    assert config == DepotConfig() and set(sources.values()) == {"default"}


# ---- precedence: defaults < file < env < arguments -------------------------------------------------

# Per key: (value written in the file, in the env, as an argument) and what each one parses to.
LADDER = {
    "chunk_size": (("chunk_size: 64", 64), ("128", 128), (512, 512)),
    "host_capacity_gb": (("max_local_cpu_size: 1.5", 1.5), ("2.5", 2.5), (3.5, 3.5)),
    "save_decode_cache": (("save_decode_cache: false", False), ("on", True), (False, False)),
    "cache_salt": (("cache_salt: from-file", "from-file"), ("from-env", "from-env"), ("from-arg", "from-arg")),
    "disk_path": (('local_disk: "file:///f"', "/f"), ("", None), ("/a", "/a")),
}


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({key: st.sets(st.sampled_from(["file", "env", "arg"])) for key in LADDER}))
def test_precedence_and_reported_sources(chosen):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        lines, env, args = [], {}, {}
        for key, where in chosen.items():
            (file_text, _), (env_raw, _), (arg, _) = LADDER[key]
            if "file" in where:
                lines.append(file_text)
            if "env" in where:
                env[f"KVDEPOT_{key.upper()}"] = env_raw
            if "arg" in where:
                args[key] = arg
        path.write_text("\n".join(lines) + "\n")
        env[CONFIG_FILE_ENV] = str(path)
        config, sources = resolve_config(args, env=env)
    defaults = DepotConfig()
    for key, where in chosen.items():
        (_, from_file), (_, from_env), (_, from_arg) = LADDER[key]
        if "arg" in where:
            expected, source = from_arg, "argument"
        elif "env" in where:
            expected, source = from_env, f"env KVDEPOT_{key.upper()}"
        elif "file" in where:
            expected, source = from_file, f"file {path}"
        else:
            expected, source = getattr(defaults, key), "default"
        assert getattr(config, key) == expected, key
        assert sources[key] == source, key


def test_load_config_reads_the_process_environment(tmp_path, monkeypatch):
    import os

    for var in [v for v in os.environ if v.startswith("KVDEPOT_")]:
        monkeypatch.delenv(var)
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 64\ncache_salt: file\nmodel_id: m\n")
    monkeypatch.setenv(CONFIG_FILE_ENV, str(path))
    monkeypatch.setenv("KVDEPOT_CACHE_SALT", "env")
    monkeypatch.setenv("KVDEPOT_MODEL_ID", "env-model")
    config = load_config(model_id="arg-model")
    assert (config.chunk_size, config.cache_salt, config.model_id) == (64, "env", "arg-model")
    monkeypatch.setenv("KVDEPOT_BOGUS", "1")
    with pytest.raises(ConfigError, match="KVDEPOT_BOGUS"):
        load_config()


def test_lower_tier_hits_defaults_to_load_and_async_is_its_old_name():
    assert resolve_config(env={})[0].lower_tier_hits == "load"
    assert resolve_config(env={"KVDEPOT_LOWER_TIER_HITS": "prefetch"})[0].lower_tier_hits == "prefetch"
    assert resolve_config(env={"KVDEPOT_LOWER_TIER_HITS": "async"})[0].lower_tier_hits == "load"  # warned once
    with pytest.raises(ConfigError, match=r"config key 'lower_tier_hits': value 'later' is not allowed; expected one of 'load', 'prefetch'"):
        load_config(lower_tier_hits="later")
