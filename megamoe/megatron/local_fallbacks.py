"""Megatron-Core's local modules without apex or Transformer Engine, on any device.

Megatron-Core falls back to plain torch modules (torch norms, torch's Adam, recomputation without
fp8) when apex and Transformer Engine are missing, and a few of those fallbacks break. Each
override below repairs one of them and does nothing when the library it stands in for is
installed; none depends on the device, so `enable_local_fallbacks()` applies them on GPUs as on
the CPU (`megamoe.megatron.runtime.setup_megatron` calls it; the specs apply
the layers' own, `LAYER_FALLBACKS`, when they are built). The overrides that stand in for
CUDA itself are `megamoe.megatron.cpu`'s. Checked against megatron-core 0.16.1 and 0.19.2.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterable

from megamoe.megatron import compat

_APPLIED: list[str] = []


def _patch_missing_te_general_gemm() -> None:
    """Define `moe_utils.te_general_gemm = None` when it is missing (0.16.1 only).

    0.16.1 imports it only when Transformer Engine imports, yet the router's gating GEMM tests
    `te_general_gemm is not None`, a NameError without TE. 0.19.x binds it to None itself.
    """
    from megatron.core.transformer.moe import moe_utils

    if compat.te_general_gemm_missing():
        moe_utils.te_general_gemm = None


def _patch_mla_transformer_engine_flag() -> None:
    """Multi-head latent attention without Transformer Engine (0.16.1 only:
    `transformer/multi_latent_attention.py`).

    0.16.1's MLA believes Transformer Engine is installed whenever Megatron's extension module
    imports (it does, with mocks in place of TE's classes), and its constructor's
    `isinstance(self.linear_proj, TELinear)` then raises a TypeError on the mock. Its flag is
    set to what the extension itself found (0.19.2 does so already).
    """
    from megatron.core.transformer import multi_latent_attention

    if compat.mla_claims_transformer_engine():
        multi_latent_attention.HAVE_TE = False


def _patch_mla_query_projection() -> None:
    """MLA's query projection without a query latent and without Transformer Engine (0.19.2:
    `transformer/mla_qk_norm_config.py`; 0.16.1 builds the spec's projection as it is).

    With `qk_layernorm` and `q_lora_rank=None`, 0.19's resolver asks for a fused norm+linear
    query projection, which only Transformer Engine has, and raises without it. DeepSeek-V2
    (arXiv 2405.04434) normalises no query latent when there is none: queries are projected
    from the normalised hidden state, which the spec's plain column-parallel projection does.
    """
    resolver = compat.mla_qk_norm_resolver()
    if resolver is None:
        return
    fused_or_default = resolver._mla_fused_linear_or_default

    def plain_query_projection_without_fusion(self, module_spec, module_name):
        if self.fused_norm_linear_impl is None and module_name == "linear_q_proj":
            return module_spec or self.linear_impl
        return fused_or_default(self, module_spec, module_name)

    resolver._mla_fused_linear_or_default = plain_query_projection_without_fusion


def _patch_sequence_parallel_norm() -> None:
    """Torch norms under sequence parallelism (0.16.1, 0.19.2: `transformer/torch_norm.py`).

    Without apex or Transformer Engine the local spec's norm is `WrappedTorchNorm`, which
    asserts `not config.sequence_parallel`. A norm is elementwise over the hidden axis, so it
    works on each tensor-parallel rank's share of the sequence as it is; what sequence
    parallelism needs is what Megatron's fused norms do: mark the weights
    `sequence_parallel=True`, so `finalize_model_grads` sums their gradients over the
    tensor-parallel group.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    new = WrappedTorchNorm.__new__

    def new_with_sequence_parallel(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return new(cls, config, *args, **kwargs)
        norm = new(cls, _without_sequence_parallel(config), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new_with_sequence_parallel)


def _patch_checkpoint_without_output() -> None:
    """Output-discarding recomputation without Transformer Engine (0.16.1, 0.19.2:
    `tensor_parallel/random.py`).

    `CheckpointWithoutOutput.__init__` sets `self.fp8 = fp8 is not None`, true for the default
    `fp8=False`, so selective recompute of `layernorm` (and `moe_act`) reaches Transformer
    Engine's `FP8GlobalStateManager`, a NameError without it. Without Transformer Engine there
    is no fp8: the flag is cleared after construction.
    """
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom, "HAVE_TE", False):
        return
    init = mrandom.CheckpointWithoutOutput.__init__

    def init_without_fp8(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    mrandom.CheckpointWithoutOutput.__init__ = init_without_fp8


def _patch_torch_adam_checkpoints() -> None:
    """Distributed-optimizer checkpoints with torch's Adam, which keeps its step in the
    per-parameter state (0.16.1, 0.19.2: `optimizer/distrib_optimizer.py`; without apex or
    Transformer Engine, whose fused Adam keeps it in the parameter groups).

    - Loading: `load_state_dict` gives every parameter's state the same `step` tensor, which
      torch's Adam then increments in place once per parameter and step (after a resume the
      bias correction runs ahead): each parameter gets its own copy. And
      `_set_main_param_and_optimizer_states` copies every state entry, `step` included, from
      the checkpoint's tensors, which hold no `step` (it comes from the parameter groups): a
      KeyError. The step is left out of that copy.
    - Saving: every rank builds the expert optimizer (its norm is reduced over all of them), so
      a pipeline stage without MoE layers (dense-first layers) holds one with no parameters and
      no state. `DistributedOptimizer.state_dict` asserts on its empty step set, and the step it
      records is what rank 0's common state carries into every loading rank. Such an optimizer
      reports the step of its ChainedOptimizer's other optimizers (all step together).
    """
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    if HAVE_APEX_OR_TE:
        return
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_but_step(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        try:
            set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values() if self.optimizer is not None else ():
            if "step" in state:
                state["step"] = state["step"].clone()

    state_dict = DistributedOptimizer.state_dict

    def state_dict_allowing_empty(self):
        if self.optimizer is None or self.optimizer.state:
            return state_dict(self)
        step = getattr(self, "chained_step", 0)
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": step}
                  for group in self.optimizer.state_dict()["param_groups"]]
        result = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    sharded_state_dict = ChainedOptimizer.sharded_state_dict

    def sharded_state_dict_sharing_step(self, *args, **kwargs):
        steps = {float(state["step"]) for optimizer in self.chained_optimizers
                 if getattr(optimizer, "optimizer", None) is not None
                 for state in optimizer.optimizer.state.values()}
        for optimizer in self.chained_optimizers:
            optimizer.chained_step = max(steps, default=0.0)
        return sharded_state_dict(self, *args, **kwargs)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_but_step
    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps
    DistributedOptimizer.state_dict = state_dict_allowing_empty
    ChainedOptimizer.sharded_state_dict = sharded_state_dict_sharing_step


def _without_sequence_parallel(config):
    """A shallow copy of `config` with `sequence_parallel=False` (no re-validation)."""
    plain = copy.copy(config)
    plain.sequence_parallel = False
    return plain


_FALLBACKS: dict[str, Callable[[], None]] = {
    "te_general_gemm": _patch_missing_te_general_gemm,
    "mla_transformer_engine_flag": _patch_mla_transformer_engine_flag,
    "mla_query_projection": _patch_mla_query_projection,
    "sequence_parallel_norm": _patch_sequence_parallel_norm,
    "checkpoint_without_output": _patch_checkpoint_without_output,
    "torch_adam_checkpoints": _patch_torch_adam_checkpoints,
}


LAYER_FALLBACKS = ("mla_transformer_engine_flag", "mla_query_projection",
                   "sequence_parallel_norm", "checkpoint_without_output")
"""The repairs that the layers of megamoe's specs need when they are built and run (the others
concern Megatron's own router and the optimizer): `megamoe.megatron.specs` applies them itself,
so Megatron-LM's `pretrain_gpt.py --spec megamoe.megatron.specs ...` needs no call."""


def enable_local_fallbacks(names: Iterable[str] = tuple(_FALLBACKS)) -> list[str]:
    """Apply the fallback repairs `names` (default: all) to the imported megatron-core, each at
    most once; return the names applied so far."""
    for name in names:
        if name not in _APPLIED:
            _FALLBACKS[name]()
            _APPLIED.append(name)
    return list(_APPLIED)
