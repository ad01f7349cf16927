"""``kvdepot bench ab``: another tree imported under its own name beside this one, and both
trees' ops timed round by round (CPU: store and retrieve; the both-at-once row needs CUDA)."""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import sys
from pathlib import Path

import pytest

import kvdepot
import kvdepot.engine
import kvdepot.keys
from kvdepot.bench import ab, common
from kvdepot.transfer import native


def _old_tree(tmp_path: Path) -> Path:
    """A copy of this tree's src as "the other tree", one function marked so it can be told apart."""
    src = tmp_path / "old-src"
    shutil.copytree(Path(kvdepot.__file__).parent, src / "kvdepot", ignore=shutil.ignore_patterns("__pycache__"))
    keys = src / "kvdepot" / "keys.py"
    keys.write_text(keys.read_text() + "\n\nOLD_TREE_MARK = True\n")
    return src


def test_the_old_tree_is_imported_under_its_own_name_with_its_own_imports(tmp_path):
    pkg = ab.import_tree(_old_tree(tmp_path), "kvdepot_old_t1", tmp_path / "into")
    old_engine = importlib.import_module("kvdepot_old_t1.engine")
    old_keys = importlib.import_module("kvdepot_old_t1.keys")
    assert Path(pkg.__file__).is_relative_to(tmp_path / "into")
    assert old_keys.OLD_TREE_MARK and not hasattr(kvdepot.keys, "OLD_TREE_MARK")
    # Its modules import each other, not this tree's.
    assert old_engine.PoolLayout.__module__ == "kvdepot_old_t1.layout"
    assert old_engine.CacheEngine is not kvdepot.engine.CacheEngine


def test_the_rewrite_renames_imports_and_nothing_else():
    text = 'import kvdepot\nfrom kvdepot.keys import ChunkKey\nfrom kvdepot import errors\nlogging.getLogger("kvdepot")\nx = "kvdepot.integrations.vllm"\n'
    assert ab._IMPORT.sub("kvdepot_old", text) == (
        'import kvdepot_old\nfrom kvdepot_old.keys import ChunkKey\nfrom kvdepot_old import errors\n'
        'logging.getLogger("kvdepot")\nx = "kvdepot_old.integrations.vllm"\n')


def test_both_trees_are_timed_round_by_round_on_cpu(tmp_path, kvdepot_env_cleared, capsys):
    parser = argparse.ArgumentParser()
    ab.add_arguments(parser)
    args = parser.parse_args(["--old", str(_old_tree(tmp_path)), "--device", "cpu", "--layers", "2", "--head-dim", "16",
                              "--tokens-per-block", "8", "--chunk-size", "32", "--blocks", "8", "--rounds", "3",
                              "--first", "old"])
    rows = ab.run(args)
    assert [r["op"] for r in rows] == ["store", "retrieve"]  # both at once: CUDA only
    assert all(r["old ratio"] > 0 and r["new ratio"] > 0 for r in rows)
    assert all(isinstance(r["new - old points"], float) for r in rows)
    out = capsys.readouterr().out
    # Each tree's own arena, in build order (--first old), where the same tree read apart (issue 19).
    assert re.search(r"^NUMA: CPUs .*; old arena pages .*; new arena pages .*; memcpy pages ", out, re.M)
    # Where each tree's copy lists come from (the copy holds this tree's C helper, if built).
    lists = "C helper" if native.NATIVE is not None else "Python"
    assert f"copy lists by {lists} (new), {lists} (old)" in out
    assert re.search(r"; CPU steal \d+ ms/s over the rounds$", out, re.M)  # whose time the rounds lost (a VM's)
    assert common.c_helper("kvdepot_no_such_tree") == "Python (no C helper in this tree)"


def test_bad_input_names_the_option_and_what_it_takes(tmp_path, kvdepot_env_cleared):
    parser = argparse.ArgumentParser()
    ab.add_arguments(parser)
    small = ["--device", "cpu", "--layers", "2", "--head-dim", "16", "--chunk-size", "32", "--blocks", "8", "--rounds", "1"]
    with pytest.raises(SystemExit, match=r"^--old .*: no kvdepot package there"):
        ab.run(parser.parse_args(["--old", str(tmp_path), *small]))
    with pytest.raises(SystemExit, match=r"^--ops: bogus unknown; choose from store, retrieve, both$"):
        ab.run(parser.parse_args(["--old", str(_old_tree(tmp_path)), "--ops", "store,bogus", *small]))
    assert not any("kvdepot-ab-" in path for path in sys.path)  # a refused run leaves no import path behind
