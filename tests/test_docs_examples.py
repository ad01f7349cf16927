"""Every example in docs/serving.md and docs/operations.md is checked: YAML and JSON parse, kvdepot
keys exist with allowed values, connector modules and classes import, every ``kvdepot`` command
line parses, every ``KVDEPOT_*`` variable is a real one, and each engine command names a config
file the page shows. Nothing here runs an engine: it keeps the docs from drifting from the code."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from kvdepot.cli import build_parser
from kvdepot.config import CONFIG_FILE_ENV, ENV_PREFIX, config_keys, resolve_config
from kvdepot.server.__main__ import build_parser as server_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["serving.md", "operations.md"]
KEYS = {f.name for f in config_keys()}
TRT_CONNECTOR_KEYS = {"connector_module", "connector_scheduler_class", "connector_worker_class"}


def blocks(page: str, lang: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(page: str) -> list[list[str]]:
    """Each shell command of the page's bash blocks, continuation lines joined, as argv."""
    out = []
    for block in blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line))
    return out


def named_yaml(page: str) -> dict[str, dict]:
    """YAML blocks whose first line names their path (``# /etc/kvdepot/x.yaml  (what)``)."""
    named = {}
    for block in blocks(page, "yaml"):
        data = yaml.safe_load(block)  # every YAML block parses
        first = block.splitlines()[0]
        if first.startswith("# "):
            named[first[2:].split()[0]] = data
    return named


def check_env(argv: list[str]) -> list[str]:
    """Strip leading VAR=value words, checking each kvdepot variable exists; returns the rest."""
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        var = argv.pop(0).split("=", 1)[0]
        if var.startswith(ENV_PREFIX):
            assert var == CONFIG_FILE_ENV or var[len(ENV_PREFIX):].lower() in KEYS, var
    return argv


def check_kvdepot_command(argv: list[str]) -> None:
    assert argv[0].endswith("kvdepot"), argv
    args = argv[1:]
    if args[:1] == ["server"]:
        server_parser().parse_args(args[1:])  # exits 2 on an unknown flag or a bad value
    else:
        build_parser(args).parse_args(args)


def check_trtllm_file(data: dict) -> None:
    assert data["kv_cache_config"]["enable_block_reuse"] is True
    connector = data["kv_connector_config"]
    assert set(connector) == TRT_CONNECTOR_KEYS, "kvdepot settings go in KVDEPOT_CONFIG_FILE, not kv_connector_config"
    module = importlib.import_module(connector["connector_module"])
    for key in ("connector_scheduler_class", "connector_worker_class"):
        assert isinstance(getattr(module, connector[key]), type)


@pytest.mark.parametrize("page", PAGES)
def test_every_command_on_the_page_is_valid(page: str) -> None:
    files = {**named_yaml("serving.md"), **named_yaml("operations.md")}
    seen = set()
    for argv in commands(page):
        argv = check_env(argv)
        if argv and argv[0] == "sudo":
            continue
        if argv[:2] == ["docker", "run"]:  # the container's command: what follows the image
            image = next(i for i, a in enumerate(argv) if a == "kvdepot" and i > 2 and not argv[i - 1].startswith("-"))
            argv = argv[image + 1:]
            for i, a in enumerate(argv[:-1]):
                assert not (a == "-e" and argv[i + 1].startswith(ENV_PREFIX)) or check_env([argv[i + 1]]) == []
            if not argv:
                continue
        if not argv or argv[0] in ("docker",):
            continue
        seen.add(argv[0])
        if argv[0] == "kvdepot":
            check_kvdepot_command(argv)
        elif argv[0] == "trtllm-serve":
            options = argv[argv.index("--extra_llm_api_options") + 1]
            assert options in files, f"{options} is not shown on the page"
            check_trtllm_file(files[options])
            assert "--backend" in argv and argv[argv.index("--backend") + 1] == "pytorch"
        elif argv[:2] == ["vllm", "serve"]:
            check_vllm_transfer_config(json.loads(argv[argv.index("--kv-transfer-config") + 1]))
        else:
            pytest.fail(f"{page}: unchecked command {argv[:3]}")
    assert "kvdepot" in seen


def check_vllm_transfer_config(config: dict) -> None:
    assert config["kv_connector"] == "KvDepotConnector" and config["kv_role"] == "kv_both"
    extra = config.get("kv_connector_extra_config", {})
    assert set(extra) <= KEYS
    resolve_config(extra, env={})  # values allowed
    # The module exists and exports the class (importing it imports vLLM: the slow test below does).
    spec = importlib.util.find_spec(config["kv_connector_module_path"])
    assert spec is not None and spec.origin is not None
    assert re.search(rf"\b{config['kv_connector']}\b", Path(spec.origin).read_text())


@pytest.mark.slow  # importing vLLM takes ~30 s on a loaded 2-core VM
def test_vllm_accepts_the_transfer_configs() -> None:
    """What each ``--kv-transfer-config`` carries passes vLLM's own validation."""
    config_module = pytest.importorskip("vllm.config")
    configs = [json.loads(a[a.index("--kv-transfer-config") + 1]) for a in map(check_env, commands("serving.md"))
               if a[:2] == ["vllm", "serve"]]
    assert configs
    for config in configs:
        parsed = config_module.KVTransferConfig(**config)
        assert parsed.kv_connector == "KvDepotConnector" and parsed.is_kv_transfer_instance
        module = importlib.import_module(config["kv_connector_module_path"])
        assert isinstance(getattr(module, config["kv_connector"]), type)


def test_the_pages_cover_both_engines_and_both_modes() -> None:
    argvs = [check_env(a) for a in commands("serving.md")]
    trt = [a for a in argvs if a[:1] == ["trtllm-serve"]]
    vllm = [a for a in argvs if a[:2] == ["vllm", "serve"]]
    assert len(trt) == 2 and len(vllm) == 2
    modules = {named_yaml("serving.md")[a[a.index("--extra_llm_api_options") + 1]]["kv_connector_config"]["connector_module"]
               for a in trt}
    assert modules == {"kvdepot.integrations.tensorrt_llm.adapter", "kvdepot.integrations.tensorrt_llm.mp_adapter"}
    assert any("server_url" in json.loads(a[a.index("--kv-transfer-config") + 1]).get("kv_connector_extra_config", {})
               for a in vllm)


def test_the_kvdepot_config_file_loads(tmp_path: Path) -> None:
    files = named_yaml("serving.md")
    path = next(p for p in files if p.endswith("/kvdepot.yaml"))
    (tmp_path / "kvdepot.yaml").write_text(yaml.safe_dump(files[path]))
    config, sources = resolve_config(env={CONFIG_FILE_ENV: str(tmp_path / "kvdepot.yaml")})
    assert config.host_capacity_gb == 64 and config.remote_url.startswith("redis://")
    assert {k for k, v in sources.items() if v.startswith("file")} == set(files[path])


def test_prometheus_config_targets_the_metrics_port() -> None:
    prom = next(b for b in blocks("operations.md", "yaml") if "scrape_configs" in b)
    target = yaml.safe_load(prom)["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target.endswith(":9400")
    server = [a for a in commands("serving.md") if a[:2] == ["kvdepot", "server"]][0]
    assert server[server.index("--metrics-port") + 1] == "9400"


def test_systemd_unit_runs_the_server_as_the_engines_user() -> None:
    unit = blocks("operations.md", "ini")[0]
    fields = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert fields["User"] and fields["RuntimeDirectory"] == "kvdepot" and fields["RuntimeDirectoryMode"] == "0700"
    argv = shlex.split(fields["ExecStart"])
    check_kvdepot_command(argv)
    url = argv[argv.index("--url") + 1]
    assert url == "ipc:///run/kvdepot/server.sock"  # inside the RuntimeDirectory
    var, path = fields["Environment"].split("=", 1)
    assert var == CONFIG_FILE_ENV and path in named_yaml("serving.md")


def test_container_recipe_installs_the_wheel_and_runs_the_server() -> None:
    recipe = blocks("operations.md", "dockerfile")[0]
    assert "COPY dist/kvdepot-*.whl" in recipe and "pip install --no-cache-dir /tmp/kvdepot-*.whl" in recipe
    cmd = json.loads(re.search(r"^CMD (.*)$", recipe, re.M).group(1))
    check_kvdepot_command(cmd)
    assert cmd[cmd.index("--metrics-host") + 1] == "0.0.0.0"
    runs = [a for a in commands("operations.md") if a[:2] == ["docker", "run"]]
    assert runs and all("--ipc=host" in a and "/run/kvdepot:/run/kvdepot" in a and "--user" in a for a in runs)
