"""Tensor parallelism for the reference runtime: one process per rank, as TensorRT-LLM 1.2 runs them.

    TpGroup.init(rank, size, init_file) -> TpGroup     torch.distributed (gloo) between the rank processes
      all_reduce(x) / broadcast(obj) / all_gather(obj)
    shard_model(model, tp) -> PagedModel               this rank's heads and MLP columns, reduce installed
    launch(target, size, *args, timeout_s=) -> list    run ``target(tp, *args)`` in ``size`` processes

What a connector sees (reference §10): a worker on every rank over that rank's own pool shard, the
scheduler on rank 0 only, whose answers reach the other ranks by broadcast (``ConnectorManager``);
``get_finished`` ids count once every rank has reported them. The rank is what TensorRT-LLM's
``tensorrt_llm._utils.mpi_rank()`` answers, so each rank process provides that helper.

Sharding follows Megatron-style TP as TensorRT-LLM does it: attention heads (and Llama's KV heads)
and the MLP's intermediate columns are split, the output projections are row-parallel and summed
by an all-reduce. A Llama rank's pool therefore holds its half of the KV heads; an MLA rank's pool
the whole latent, which ``kv_a_proj`` (replicated) makes the same on every rank.

Collectives run over gloo on CPU tensors, so two ranks may share one GPU (NCCL refuses that):
slower than TensorRT-LLM's, irrelevant to what a connector sees.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvdepot.errors import ConfigError


@dataclass(frozen=True)
class TpGroup:
    """This process's place among the TP ranks."""

    rank: int
    size: int

    @classmethod
    def init(cls, rank: int, size: int, init_file: str | Path) -> TpGroup:
        """Join the ranks' gloo group (a shared file rendezvous) and provide ``mpi_rank()``."""
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
        provide_mpi_rank(rank)
        return cls(rank, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (a row-parallel layer's partial outputs), on ``x``'s device."""
        host = x.detach().to("cpu", copy=True)
        dist.all_reduce(host)
        return host.to(x.device)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (TensorRT-LLM's ``mpi_broadcast`` of the scheduler's answers)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def provide_mpi_rank(rank: int) -> None:
    """Where connectors read the rank (``tensorrt_llm._utils.mpi_rank``): a stand-in module, unless
    TensorRT-LLM itself is importable."""
    try:
        import tensorrt_llm  # type: ignore[import-not-found]  # noqa: F401
        return
    except ImportError:
        pass
    package = types.ModuleType("tensorrt_llm")
    utils = types.ModuleType("tensorrt_llm._utils")
    utils.mpi_rank = lambda: rank  # type: ignore[attr-defined]
    package._utils = utils  # type: ignore[attr-defined]
    sys.modules["tensorrt_llm"], sys.modules["tensorrt_llm._utils"] = package, utils


def _rows(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = w.shape[0] // size
    return w[rank * n : (rank + 1) * n].contiguous()


def _cols(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = w.shape[1] // size
    return w[:, rank * n : (rank + 1) * n].contiguous()


def shard_model(model: Any, tp: TpGroup) -> Any:
    """``model`` (full weights, the same seed on every rank) cut down to rank ``tp.rank``'s part."""
    from kvdepot.runtime.mla import MlaConfig, MlaModel, MlaWeights
    from kvdepot.runtime.model import LlamaModel
    from kvdepot.runtime.weights import LlamaWeights

    c, r, n = model.config, tp.rank, tp.size
    split = {"num_heads": c.num_heads, "intermediate_size": c.intermediate_size}
    if not isinstance(c, MlaConfig):
        split["num_kv_heads"] = c.num_kv_heads
    uneven = [f"{k}={v}" for k, v in split.items() if v % n]
    if uneven:
        raise ConfigError(f"tensor_parallel_size={n} must divide {', '.join(uneven)}")
    config = replace(c, **{k: v // n for k, v in split.items()})
    w = model.weights
    column = ("q_proj", "k_proj", "v_proj", "kv_b_proj", "gate_proj", "up_proj")  # output rows split
    row = ("o_proj", "down_proj")  # input columns split; outputs summed over ranks
    layers = []
    for lw in w.layers:
        parts = {name: _rows(getattr(lw, name), r, n) for name in column if hasattr(lw, name)}
        parts.update({name: _cols(getattr(lw, name), r, n) for name in row})
        layers.append(replace(lw, **parts))
    if isinstance(model, MlaModel):
        sharded: Any = MlaModel(config, MlaWeights(w.embed, layers, w.norm, w.lm_head))
    else:
        sharded = LlamaModel(config, LlamaWeights(w.embed, layers, w.norm, w.lm_head))
    assert isinstance(sharded, (LlamaModel, MlaModel))
    sharded.reduce = tp.all_reduce
    return sharded


# ---- launching rank processes ---------------------------------------------------------------------
def _rank_main(target: Callable[..., Any], rank: int, size: int, init_file: str, args: tuple,
               results: Any) -> None:
    tp = TpGroup.init(rank, size, init_file)
    try:
        results.put((rank, True, target(tp, *args)))
    except BaseException:  # reported to the launcher, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        tp.close()


def launch(target: Callable[..., Any], size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``target(tp, *args)`` on ``size`` fresh rank processes (spawned: importable ``target``, picklable
    args and results); returns each rank's result, in rank order, or raises with a rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="kvd-tp-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(target, r, size, init_file, args, results), daemon=True)
                 for r in range(size)]
        for proc in procs:
            proc.start()
        out: dict[int, Any] = {}
        try:
            for _ in range(size):
                rank, ok, value = results.get(timeout=timeout_s)
                if not ok:
                    raise RuntimeError(f"TP rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
            results.close()
            results.join_thread()
    return [out[r] for r in range(size)]
