"""`--measure`: train a layout for a few steps on the CPU (gloo, one process per rank) and
record what each rank really holds, per category, to set beside the plan.

What is recorded, per rank (`megamoe.plan.tracker`, `megamoe.plan.state`):
- parameters, gradients, optimizer: the distinct storages of the trained model's parameters,
  of its gradient buffers, and of the optimizer's own tensors (fp32 main weights where they
  are copies, Adam's moments), after the steps;
- activations and moe_dispatch: the peak over the steps of the bytes of tensors autograd held
  for the backward pass (saved-tensor hooks), the MoE layer's routed path (router, balance
  losses, dispatch, experts, combine; its shared expert and its input excepted) counted as
  moe_dispatch.

The run is the trainer's: `build_model`, `Engine` (Megatron-Core DDP, distributed optimizer,
pipeline schedules), `step_balancing`, on synthetic token batches. The routing is forced to
the plan's imbalance: every router's selection is replaced by a fixed pattern in which the
local experts of expert-parallel rank 0 take (1 + MaxVio) times the mean load each (as far as
tokens allow), the rest share the remaining assignments evenly (`forced_loads`), so rank 0 of
every expert-parallel group is the planned busiest rank. Gates keep the router's
probabilities on the forced experts, so the router trains as usual.
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
from typing import Any

import torch

from megamoe.errors import MegaMoEError
from megamoe.parallel.spawn import spawn_ranks
from megamoe.plan.tracker import ACTIVATIONS, MOE, SavedTensorTracker

STEPS = 2
"""Optimizer steps a measurement runs (the optimizer state exists after the first)."""


def forced_loads(tokens: int, num_experts: int, topk: int, local: int, maxvio: float
                 ) -> list[int]:
    """Assignments per expert: the first `local` experts take (1 + maxvio) x the mean
    T k / E each (at most T each, and at most T min(local, k) together), the others share the
    rest evenly (at most T each)."""
    total = tokens * topk
    hot_cap = min(round((1 + maxvio) * total / num_experts), tokens)
    budget = min(local * hot_cap, tokens * min(local, topk))
    loads = [0] * num_experts
    for expert in range(local):
        loads[expert] = min(hot_cap, budget)
        budget -= loads[expert]
    rest, others = total - sum(loads), num_experts - local
    for i in range(others):
        loads[local + i] = rest // others + (1 if i < rest % others else 0)
    if max(loads) > tokens or sum(loads) != total:
        raise MegaMoEError(f"cannot force MaxVio {maxvio} on {num_experts} experts, top-"
                           f"{topk}, {tokens} tokens: use a smaller --maxvio")
    return loads


def forced_map(tokens: int, loads: list[int]) -> torch.Tensor:
    """A routing map [T, E] with these per-expert loads and no token twice at one expert: the
    assignments, expert by expert, fill the T x k slots column by column (a run of at most T
    consecutive slots never holds a token twice)."""
    experts = torch.repeat_interleave(torch.arange(len(loads)), torch.tensor(loads))
    slot = torch.arange(experts.numel())
    map_TE = torch.zeros(tokens, len(loads), dtype=torch.bool)
    map_TE[slot % tokens, experts] = True
    return map_TE


def maxvio_of(loads: list[int]) -> float:
    """MaxVio of these loads: max / mean - 1 (arXiv 2408.15664)."""
    return max(loads) * len(loads) / sum(loads) - 1


def _force_routing(layer, maxvio: float, record: dict) -> None:
    """Replace `layer`'s routing with the forced pattern (see the module docstring)."""
    cfg, ep = layer.cfg, layer.ep_comm.size

    def hook(router, args, routing):
        T, E = routing.selected_TE.shape
        loads = forced_loads(T, E, cfg.topk, E // ep, maxvio)
        map_TE = forced_map(T, loads).to(routing.selected_TE.device)
        record["maxvio"] = max(record.get("maxvio", 0.0), maxvio_of(loads))
        return dataclasses.replace(routing, selected_TE=map_TE, routing_map_TE=map_TE,
                                   gates_TE=routing.probs_TE * map_TE)

    layer.router.register_forward_hook(hook)


def _instrument(layer, tracker: SavedTensorTracker, record: dict) -> None:
    """Count what `layer` saves outside its shared expert and input as MoE dispatch buffers;
    record the rows its experts receive."""
    def enter(module, args, kwargs=None):
        tracker.as_activation(args[0])
        tracker.current = MOE

    def leave(module, args, output):
        tracker.current = ACTIVATIONS
        tracker.forget_hints()

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)
    if layer.shared_experts is not None:
        layer.shared_experts.register_forward_pre_hook(
            lambda m, a: setattr(tracker, "current", ACTIVATIONS))
        layer.shared_experts.register_forward_hook(
            lambda m, a, o: setattr(tracker, "current", MOE))

    def rows(module, args):
        record["rows"] = max(record.get("rows", 0), int(args[0].shape[0]))

    layer.experts.register_forward_pre_hook(rows)


def _batches(config, vocab: int, step: int, count: int, dp_rank: int):
    """Synthetic micro-batches of this data-parallel rank (the same on its tensor and
    pipeline peers)."""
    from megamoe.train.data import Batch

    b, s = config.training.micro_batch_size, config.model.seq_length
    for index in range(count):
        generator = torch.Generator().manual_seed(step * 1_000_003 + index * 1009 + dp_rank)
        tokens = torch.randint(0, vocab, (b, s + 1), generator=generator)
        yield Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.ones(b, s),
                    torch.arange(s).expand(b, s).contiguous())


def measure_rank(config, maxvio: float, steps: int = STEPS) -> dict[str, Any]:
    """Train `config`'s layout (Megatron already set up on this rank) for `steps` steps and
    return what this rank held: bytes per category, the forced MaxVio, rows received."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megamoe.balancing import step_balancing
    from megamoe.layer import MoELayer
    from megamoe.parallel.comm import TorchComm
    from megamoe.plan.shards import model_vocab_size
    from megamoe.plan.state import model_state_bytes, state_storages
    from megamoe.train.engine import Engine
    from megamoe.train.loop import microbatches_per_step
    from megamoe.train.model import build_model, transformer_config

    vocab, _ = model_vocab_size(config)
    tc = transformer_config(config, on_cuda=False, bf16=False)
    chunks = build_model(config, tc, vocab)
    engine = Engine(chunks, tc, config, on_cuda=False)
    tracker = SavedTensorTracker(state_storages(chunks))
    record: dict = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                _force_routing(module, maxvio, record)
                _instrument(module, tracker, record)
    model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
    dp_rank = parallel_state.get_data_parallel_rank()
    microbatches = microbatches_per_step(config, parallel_state.get_data_parallel_world_size())
    replica = TorchComm(ProcessGroupCollection.use_mpu_process_groups().tp_dp_cp)
    for step in range(1, steps + 1):
        with tracker:
            engine.forward_backward(_batches(config, vocab, step, microbatches, dp_rank),
                                    microbatches, step)
        norm = engine.grad_norm()
        step_balancing(model, replica)
        engine.step(norm)
    return {**model_state_bytes(chunks, engine.optimizer), **tracker.peak,
            "maxvio": record.get("maxvio"), "rows": record.get("rows", 0),
            "stage": parallel_state.get_pipeline_model_parallel_rank()}


def _measure_ranks(rank: int, world: int, runs: list[dict], steps: int) -> dict:
    """One rank of `measure`: each run's `measure_rank` in turn, Megatron set up for its layout."""
    import logging
    import warnings

    import torch.distributed as dist

    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.train.config import config_from_dict

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method="env://")
    results = {}
    for index, run in enumerate(runs):
        config = config_from_dict(run["config"])
        p = config.parallel
        setup_megatron(tensor_model_parallel_size=p.tensor,
                       pipeline_model_parallel_size=p.pipeline,
                       virtual_pipeline_model_parallel_size=p.virtual_stages,
                       expert_model_parallel_size=p.expert, seed=config.training.seed)
        try:
            results[run["name"]] = measure_rank(config, run["maxvio"], steps)
        finally:
            teardown_megatron()
        if rank == 0:
            print(f"measured {run['name']} ({index + 1}/{len(runs)})", file=sys.stderr,
                  flush=True)
    return results


def measure(runs: list[dict], world: int, steps: int = STEPS, timeout_s: float = 900.0
            ) -> dict[str, list[dict]]:
    """Measure each run ({"name", "config": plain config data, "maxvio"}), all at the same
    world size, in one set of `world` spawned CPU processes (gloo); returns
    {name: [rank 0 result, rank 1 result, ...]} (`measure_rank`)."""
    with tempfile.TemporaryDirectory(prefix="megamoe-measure-") as out_dir:
        try:
            per_rank = spawn_ranks(world, _measure_ranks, out_dir, timeout_s, runs=runs,
                                   steps=steps)
        except TimeoutError as err:
            raise MegaMoEError(f"--measure: {err}; measure a smaller config") from None
        except RuntimeError as err:
            raise RuntimeError(f"--measure: {err}") from None
    return {run["name"]: [ranks[run["name"]] for ranks in per_rank] for run in runs}
