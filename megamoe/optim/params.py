"""Which optimizer updates each parameter of a model when it trains with Muon, by module and
parameter kind (never by guessing from a name).

Muon, the orthogonalised update, is defined for the weight matrices of hidden layers (Jordan et
al. 2024: "Muon should only be used for hidden weight layers. The input embedding, final output
layer, and any internal gains or biases should be optimized using a standard method such as
AdamW"; Moonlight, arXiv 2502.16982, section 2: Muon for the matrix parameters, AdamW for the
rest, the embedding and the output head included). So:

Muon (`Matrix`):
- the weight of every linear layer (attention QKV, output projection, MLA's down and up
  projections, dense-MLP fc1 and fc2, the shared experts' fc1 and fc2): one matrix, its
  tensor-parallel split from Megatron's `tensor_model_parallel` / `partition_dim` attributes.
  A fused QKV weight stays one matrix (Jordan's and Moonlight's runs differ here; Megatron-Core
  offers both): only GLU halves are split, see below.
- megamoe's `GroupedExperts` weights fc1 [E, F', D] and fc2 [E, D, F]: stacked, one matrix per
  expert. An expert is its own MLP; stacking its weights with its neighbours' is a storage
  layout, and orthogonalising the stack would couple the experts (one expert's update would
  depend on the others' gradients, and would be scaled by the stack's shape). Experts are never
  tensor-parallel in megamoe (their `tensor_model_parallel` attribute only tells Megatron's
  gradient norm to count them on every rank).
- gated (GLU) fc1 weights, of experts, shared experts and dense MLPs: the gate and up halves
  (rows [gate; up], recognised by fc1 having twice fc2's inner width) are two matrices. The
  models Muon was scaled on (Moonlight, and Kimi-K2 with MuonClip: DeepSeek-V3's architecture)
  have gate_proj and up_proj as separate linear layers, each orthogonalised on its own;
  megamoe fuses them only for storage.

AdamW (with the reason):
- embeddings (`nn.Embedding`, or a parameter Megatron marks `is_embedding_or_output_parameter`)
  and the output layer: Jordan et al. and Moonlight keep them on AdamW (an embedding's rows are
  independent lookups, not a linear map of its input; the head's best-known update is AdamW's).
- vectors: norm gains and biases, the experts' flat stacked biases included (no matrix to
  orthogonalise).
- routers (megamoe `Router`, their gate weight [E, D]): a score per expert, trained with the
  balancing losses; orthogonalising would give every expert's row an update of the same size
  whatever its gradient, as if every expert were equally loaded. Kept on AdamW, as the
  shared-expert gate [1, D] (a gate, and a vector in matrix form). The expert bias of loss-free
  balancing is a buffer updated by its own rule, not by any optimizer.
Anything else (a tensor of more than two dimensions that is not a stacked expert weight, a 2-D
parameter not a linear layer's weight) is refused: a `ConfigError` naming it.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional

import torch
from torch import nn

from megamoe.errors import ConfigError
from megamoe.experts.grouped import GroupedExperts
from megamoe.optim.muon import Matrix
from megamoe.routing.base import Router


class Treatment(NamedTuple):
    """A parameter's optimizer: `matrix` set for Muon, None for AdamW; `kind` says why."""

    kind: str
    matrix: Optional[Matrix] = None


def _tp_dim(param: torch.Tensor) -> Optional[int]:
    if getattr(param, "tensor_model_parallel", False):
        return getattr(param, "partition_dim", None)
    return None


def _is_glu_fc1(module: nn.Module, name: str) -> bool:
    """`name` is module's fc1 and fc1 has twice the rows that fc2 has columns (a GLU)."""
    if isinstance(module, GroupedExperts):
        return name == "fc1_weight" and module.fc1_weight.shape[1] == 2 * module.fc2_weight.shape[2]
    fc1, fc2 = getattr(module, "linear_fc1", None), getattr(module, "linear_fc2", None)
    weight1, weight2 = getattr(fc1, "weight", None), getattr(fc2, "weight", None)
    return (name == "linear_fc1" and weight1 is not None and weight2 is not None
            and weight1.dim() == 2 and weight1.shape[0] == 2 * weight2.shape[1])


def _modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module, str]]:
    """(full name, module, parent, name in parent) of every module."""
    yield "", model, model, ""
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            yield (f"{parent_name}.{child_name}" if parent_name else child_name, child, parent,
                   child_name)


def classify(model: nn.Module) -> list[tuple[str, nn.Parameter, Treatment]]:
    """(name, parameter, treatment) of every trainable parameter of `model` (see the module
    docstring); a parameter no rule covers is a ConfigError."""
    found, seen = [], set()
    routers = [m for m in model.modules() if isinstance(m, Router)]
    in_router = {id(p) for r in routers for p in r.parameters()}
    for module_name, module, parent, local in _modules(model):
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{name}" if module_name else name
            found.append((full, param, _treatment(full, param, module, parent, local, name,
                                                  id(param) in in_router)))
    return found


def _treatment(full: str, param: nn.Parameter, module: nn.Module, parent: nn.Module,
               local: str, name: str, in_router: bool) -> Treatment:
    if isinstance(module, GroupedExperts) and name in ("fc1_weight", "fc2_weight"):
        return Treatment("stacked expert weight",
                         Matrix(stacked=True, glu_halves=_is_glu_fc1(module, name)))
    if in_router:
        return Treatment("router")
    if isinstance(module, nn.Embedding) or getattr(param, "is_embedding_or_output_parameter",
                                                   False):
        return Treatment("embedding or output layer")
    if param.dim() == 1:
        return Treatment("norm or bias")
    if name == "gate_weight" and param.dim() == 2 and param.shape[0] == 1:
        return Treatment("shared-expert gate")
    if name == "weight" and param.dim() == 2:
        return Treatment("linear weight", Matrix(glu_halves=_is_glu_fc1(parent, local),
                                                 tp_dim=_tp_dim(param)))
    raise ConfigError(
        f"optimizer.name=muon: parameter {full} of shape {list(param.shape)} "
        f"({type(module).__name__}) is neither a linear weight, a stacked expert weight nor a "
        f"kind AdamW takes (embedding, output, norm, bias, router, gate); use "
        f"optimizer.name=adamw for this model")


def split_parameters(model: nn.Module) -> tuple[list[tuple[nn.Parameter, Matrix]],
                                                list[nn.Parameter]]:
    """(Muon's parameters with their matrices, AdamW's parameters) of `model`."""
    muon, adamw = [], []
    for _, param, treatment in classify(model):
        if treatment.matrix is None:
            adamw.append(param)
        else:
            muon.append((param, treatment.matrix))
    return muon, adamw
