"""UpcycleRecipe: every choice of a dense -> MoE conversion in one validated dataclass.

The recipe is written into the output checkpoint's metadata (`to_dict`), and says which
Megatron-Core MoE settings the output must be trained with (`megatron_settings`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

from megamoe.errors import ConfigError
from megamoe.settings import check_choice

ROUTER_INITS = ("virtual_group", "random", "zero")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
WEIGHT_SCALINGS = ("exact", "paper", "none")
ACTIVATIONS = ("swiglu", "gelu", "squared_relu", "relu")
KEY_LAYOUTS = ("auto", "stacked", "per_layer", "singleton")
TARGET_SPECS = ("local", "te")


@dataclass(frozen=True)
class UpcycleRecipe:
    num_experts: int
    """Routed experts E per MoE layer."""

    topk: int
    """Experts per token K the MoE model will be trained with."""

    granularity: int = 1
    """G = dense FFN size / expert FFN size. 1 is sparse upcycling (every expert a full copy,
    arXiv 2212.05055); G > 1 is granular upcycling with virtual groups (arXiv 2410.07524)."""

    router_init: str = "virtual_group"
    """`virtual_group`: E/G random rows, each repeated G times, so the G shards of one copy of
    the dense MLP score alike (arXiv 2410.07524); `random`: E independent rows; `zero`."""

    router_init_std: float = 0.02
    """Std of the normal router init."""

    score_function: str = "softmax"
    """Router score function of the MoE model (`softmax` or `sigmoid`)."""

    pre_softmax: bool = False
    """softmax only: the MoE model applies softmax before top-K selection (gates not
    renormalised over the chosen experts). Changes the weight-scaling factor."""

    weight_scaling: str = "exact"
    """How the output scale (see `granular.output_scale`) is folded into the expert weights:
    `exact` puts it only where the MLP is linear in the weight (GLU up half and fc2, or fc2), which
    preserves the dense function exactly; `paper` applies scale^(1/3) per matrix for GLU and
    squared-ReLU MLPs and scale^(1/2) otherwise (arXiv 2410.07524); `none` leaves weights as is."""

    activation: Optional[str] = None
    """Dense MLP activation (`swiglu`, `gelu`, `squared_relu`, `relu`); only the `paper` scaling
    needs it. None: `swiglu` for GLU MLPs, else read from the checkpoint's args, else `gelu`."""

    drop_ratio: float = 0.0
    """Drop-upcycling (arXiv 2502.19261): fraction r of each expert's intermediate neurons that is
    re-initialised, a different random subset per expert. 0 disables it; the paper's best is 0.5."""

    noise_std: float = 0.0
    """Relative std of Gaussian noise added to every expert matrix (times that matrix's std)."""

    shared_expert: bool = False
    """Add a shared expert made from the dense MLP. Its output and the routed experts' are each
    halved, so the layer still computes the dense function when the routed part does."""

    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x . w_gate), as in Qwen2-MoE; w_gate
    starts at zero, so the gate is 0.5 and takes the place of halving the shared expert's
    weights (the dense function is still preserved). Needs `shared_expert`."""

    moe_layers: Union[str, int, tuple] = "all"
    """Which layers become MoE: `all`, every n-th (an int n, Megatron's `moe_layer_freq=n`:
    layers 0, n, 2n, ...), or a tuple of 0-based layer indices."""

    key_layout: str = "auto"
    """Checkpoint key layout: `stacked` (layers folded into one tensor, Megatron's default when
    every layer is MoE), `per_layer` (`decoder.layers.{i}.` keys, Megatron's layout for mixed
    dense/MoE layer patterns), `singleton` (Megatron's `singleton_local_shards` layout), or `auto`
    (stacked when every layer is MoE, else per_layer)."""

    target_spec: str = "local"
    """Megatron layer spec the MoE model is built with: `local` stores the pre-MLP norm of MoE
    layers as `mlp.linear_fc1.layer_norm_*`, `te` (Transformer Engine) as `pre_mlp_layernorm.*`."""

    seed: int = 1234
    """Seed of every random choice (router rows, dropped neurons, noise)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "topk", "granularity"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.topk > self.num_experts:
            raise ConfigError(f"topk={self.topk} exceeds num_experts={self.num_experts}; "
                              "choose topk <= num_experts")
        if self.num_experts % self.granularity:
            raise ConfigError(
                f"num_experts={self.num_experts} is not divisible by granularity="
                f"{self.granularity}; each copy of the dense MLP is split into G experts, so pick "
                "E a multiple of G")
        check_choice("router_init", self.router_init, ROUTER_INITS)
        check_choice("score_function", self.score_function, SCORE_FUNCTIONS)
        check_choice("weight_scaling", self.weight_scaling, WEIGHT_SCALINGS)
        check_choice("key_layout", self.key_layout, KEY_LAYOUTS)
        check_choice("target_spec", self.target_spec, TARGET_SPECS)
        if self.activation is not None:
            check_choice("activation", self.activation, ACTIVATIONS)
        if self.shared_expert_gate and not self.shared_expert:
            raise ConfigError("shared_expert_gate=True needs shared_expert=True")
        if self.pre_softmax and self.score_function != "softmax":
            raise ConfigError("pre_softmax=True needs score_function='softmax'")
        if not 0.0 <= self.drop_ratio <= 1.0:
            raise ConfigError(f"drop_ratio={self.drop_ratio} must be in [0, 1]")
        for name in ("noise_std", "router_init_std"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ConfigError(f"{name}={value} must be a finite number >= 0")
        _check_moe_layers(self.moe_layers)
        if self.key_layout == "stacked" and self.moe_layers not in ("all", 1):
            raise ConfigError(f"key_layout='stacked' with moe_layers={self.moe_layers!r}: "
                              "Megatron stacks layers only when all are alike; use per_layer")

    @property
    def renormalised_gates(self) -> bool:
        """True when the MoE model's gate weights over the chosen experts sum to 1 (softmax
        after selection, or sigmoid with K > 1; both Megatron-Core and megamoe renormalise)."""
        if self.score_function == "softmax":
            return not self.pre_softmax
        return self.topk > 1

    def function_preserving(self, gated: bool, activation: str) -> tuple[bool, str]:
        """Whether the upcycled model computes exactly the dense function, and why not if not.

        gated, activation: the dense MLP's (GLU or not; resolved activation name).
        """
        if self.topk % self.granularity:
            return False, f"topk={self.topk} is not a multiple of granularity={self.granularity}"
        if self.granularity > 1 and self.router_init != "virtual_group":
            return False, (f"router_init={self.router_init!r} with granularity={self.granularity} "
                           "scores the shards of one dense copy independently, so a token's "
                           "top-k mixes shards of different copies")
        if not self.renormalised_gates:
            return False, "gates are not renormalised over the chosen experts"
        if self.drop_ratio > 0 or self.noise_std > 0:
            return False, "drop-upcycling or noise changes the experts"
        needs_scaling = self.granularity > 1 or self.shared_expert
        if needs_scaling and self.weight_scaling == "none":
            return False, "weight_scaling='none' leaves the routed output scaled down"
        if needs_scaling and self.weight_scaling == "paper" and (
                gated or activation not in ("squared_relu", "relu")):
            return False, (f"the paper's per-matrix scaling is exact only for homogeneous "
                           f"activations, not {activation}")
        return True, ""

    def layer_pattern(self, num_layers: int) -> list[bool]:
        """Per layer (0-based): True if it becomes MoE."""
        spec = self.moe_layers
        if spec == "all":
            return [True] * num_layers
        if isinstance(spec, int):
            return [i % spec == 0 for i in range(num_layers)]
        bad = [i for i in spec if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(f"moe_layers {bad} are outside the checkpoint's layers "
                              f"0..{num_layers - 1}")
        return [i in spec for i in range(num_layers)]

    def moe_layer_freq(self, num_layers: int) -> Union[int, list[int]]:
        """Megatron-Core's `moe_layer_freq` value that builds this layer pattern."""
        if self.moe_layers == "all":
            return 1
        if isinstance(self.moe_layers, int):
            return self.moe_layers
        return [int(moe) for moe in self.layer_pattern(num_layers)]

    def resolved_key_layout(self) -> str:
        """`auto` resolved the way Megatron-Core's TransformerBlock decides it."""
        if self.key_layout != "auto":
            return self.key_layout
        return "stacked" if self.moe_layers in ("all", 1) else "per_layer"

    def megatron_settings(self, num_layers: int, dense_ffn_size: int) -> dict:
        """The Megatron-Core TransformerConfig `moe_*` fields the MoE model must use."""
        gate = {"moe_shared_expert_gate": True} if self.shared_expert_gate else {}
        return dict(
            **gate,
            num_moe_experts=self.num_experts,
            moe_router_topk=self.topk,
            moe_ffn_hidden_size=dense_ffn_size // self.granularity,
            moe_layer_freq=self.moe_layer_freq(num_layers),
            moe_router_score_function=self.score_function,
            moe_router_pre_softmax=self.pre_softmax,
            moe_shared_expert_intermediate_size=dense_ffn_size if self.shared_expert else None,
        )

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        if isinstance(self.moe_layers, tuple):
            values["moe_layers"] = list(self.moe_layers)
        return values


def parse_moe_layers(text: str) -> Union[str, int, tuple]:
    """CLI form of `UpcycleRecipe.moe_layers`: `all`, `every:N`, or `0,2,5`."""
    text = text.strip()
    if text == "all":
        return "all"
    try:
        if text.startswith("every:"):
            return int(text[len("every:"):])
        return tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ConfigError(f"--moe-layers {text!r} is not `all`, `every:N` or a comma list of "
                          "layer indices like 0,2,5") from None


def _check_moe_layers(spec) -> None:
    if spec == "all":
        return
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec <= 0:
            raise ConfigError(f"moe_layers=every:{spec} needs a positive interval")
        return
    if isinstance(spec, tuple) and spec and all(isinstance(i, int) for i in spec):
        return
    raise ConfigError(f"moe_layers={spec!r} must be 'all', a positive int or a non-empty tuple "
                      "of layer indices")


