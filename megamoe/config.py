"""MoEConfig: every knob of a megamoe layer in one validated dataclass.

Validation lives in `MoEConfig.__post_init__` (and `check_expert_parallel` for the one check that
needs the expert-parallel size); every error names the offending value and the fix. The names
`router_type`, `dispatcher` and `activation` may take come from the registries of
`megamoe.registry`, which the implementations fill (importing `megamoe` imports them all).
Megatron-Core's own `moe_*` fields map onto it in the adapter
(`megamoe.megatron.fields.moe_config_from_transformer_config`).
`moe_layer_pattern` says which layers of a model are MoE (Megatron's `moe_layer_freq`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from megamoe.errors import ConfigError
from megamoe.registry import ACTIVATIONS, DISPATCHERS, ROUTERS

SCORE_FUNCTIONS = ("softmax", "sigmoid")
BIAS = "bias"
ADAPTIVE_AUX = "adaptive_aux_loss"
BALANCE_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss", ADAPTIVE_AUX)
BALANCING = (BIAS, *BALANCE_LOSSES, "none")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class MoEConfig:
    hidden_size: int
    """Model hidden size H (the layer's input and output width)."""

    num_experts: int
    """Number of routed experts E in this layer."""

    ffn_hidden_size: int
    """Intermediate size of one routed expert (per GLU half for swiglu)."""

    topk: int = 2
    """Experts per token for the `topk` router; also the nominal K used by capacity planning."""

    router_type: str = "topk"
    """`topk` (fixed K per token), `top_p` (dynamic top-p, Huang et al. ACL 2024), `threshold`
    (expert-threshold routing, arXiv 2603.11535), `sinkhorn` (balanced optimal transport) or
    `base` (BASE layers' balanced assignment, arXiv 2103.16716); see `megamoe.routing`."""

    score_function: str = "softmax"
    """`softmax` or `sigmoid` router scores."""

    pre_softmax: bool = False
    """softmax only: gates are the softmax over all experts (True) or renormalised over the chosen
    ones, i.e. softmax after selection (False)."""

    topk_scaling_factor: Optional[float] = None
    """Multiplier on the gate weights (DeepSeek-V3 uses 2.5); None leaves them unscaled."""

    num_groups: Optional[int] = None
    """Group-limited routing (DeepSeek-V2/V3): split the experts into this many equal groups
    (devices or nodes). None disables it."""

    groups_per_token: Optional[int] = None
    """Group-limited routing: how many groups a token may pick its experts from."""

    group_score_topk: Optional[int] = None
    """Group-limited routing: a group's score is the sum of its this-many best (biased) expert
    scores (DeepSeek-V3: 2, whatever its top-k). None takes Megatron-Core's rule, topk /
    groups_per_token, which needs topk to be a multiple of groups_per_token."""

    balancing: Union[str, list[str]] = "aux_loss"
    """One of, or a list combining: `bias` (loss-free balancing, arXiv 2408.15664),
    `aux_loss` (Switch loss, arXiv 2101.03961, counts over the micro-batch's whole sequences),
    `global_aux_loss` (Switch loss with counts over every replica of the router, averaged over
    the step's micro-batches, arXiv 2501.11873), `seq_aux_loss` (per sequence, DeepSeek-V2,
    arXiv 2405.04434), `adaptive_aux_loss` (the Switch loss with Skywork-MoE's per-layer
    coefficient adapted to the layer's token-drop rate, arXiv 2406.06563; its `aux_loss_coeff`
    is the starting value), or `none`. DeepSeek-V3's recipe is ["bias", "seq_aux_loss"] with
    aux_loss_coeff 1e-4. The z-loss combines with any."""

    bias_update_rate: float = 1e-3
    """Loss-free balancing: step u of `bias += u * sign(mean(c) - c)`."""

    bias_mean_centering: bool = False
    """Loss-free balancing: subtract the mean of each update so mean(bias) stays 0."""

    aux_loss_coeff: Union[float, list[float]] = 1e-2
    """Weight of the load-balancing losses in `balancing`: one value for all of them, or a list
    with one value per loss, in the order of `balancing` (`bias` and `none` take none), as
    Megatron's `moe_aux_loss_coeff` list."""

    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE, arXiv 2202.08906); 0 disables it."""

    capacity_factor: Optional[float] = None
    """Per-expert capacity = ceil(capacity_factor * routed assignments / E), counted per forward
    call (per rank). None means dropless."""

    drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: highest gate (`probs`) or earliest (`position`)."""

    activation: str = "swiglu"
    """Expert activation: `swiglu` (GLU with SiLU), `gelu` or `squared_relu`."""

    shared_expert_ffn_size: Optional[int] = None
    """Intermediate size of the always-on shared expert; None means no shared expert."""

    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w_gate)."""

    top_p_threshold: float = 0.4
    """top_p router: choose the smallest set of experts whose probability mass reaches p."""

    entropy_loss_coeff: float = 1e-4
    """top_p router: weight of the entropy ("dynamic") loss that keeps P from flattening."""

    gate_logit_norm: Optional[float] = None
    """Skywork-MoE gating-logit normalisation (arXiv 2406.06563): z <- lambda * (z - mean(z)) /
    std(z) per token before the score function, with lambda this value (any router). None
    disables it."""

    adaptive_aux_decay: float = 0.99
    """`adaptive_aux_loss`: beta of Skywork-MoE's coefficient update alpha <- beta * alpha +
    (1 - beta) * xi * d, d the layer's token-drop rate of the step (a knob: the paper's value
    is not restated here)."""

    adaptive_aux_sensitivity: float = 0.1
    """`adaptive_aux_loss`: xi of that update (the coefficient a drop rate of 100% would
    settle at; 10% drops settle at 0.1 * xi). The drop rate is measured at `capacity_factor`,
    or, dropless, as the share of assignments above capacity factor 1."""

    threshold_ema_decay: float = 0.99
    """`threshold` router: beta of the per-expert threshold EMA (the public code's 0.99; the
    paper uses 0.999 for long runs)."""

    threshold_warmup_steps: int = 100
    """`threshold` router: optimizer steps of plain expert-choice routing before the thresholds
    take over (the paper warms up for about 4k steps of a long run)."""

    threshold_capacity: Optional[float] = 0.5
    """`threshold` router, training only: each expert takes between (1 - C) and (1 + C) times
    its mean share N * topk / E of a micro-batch's N tokens (excess dropped by logit, shortfall
    filled with the next-best tokens). None: no bounds."""

    sinkhorn_tolerance: float = 1e-4
    """`sinkhorn` router: stop when every expert's share of the transport plan is within this
    relative tolerance of 1/E."""

    sinkhorn_max_iterations: int = 100
    """`sinkhorn` router: cap on the Sinkhorn iterations per forward."""

    erc_loss_coeff: float = 0.0
    """Weight of the expert-router coupling loss (arXiv 2512.23447, any router); 0 disables it."""

    erc_noise: float = 0.1
    """ERC loss: proxy tokens are the router rows times noise uniform in [1 - eps, 1 + eps]."""

    erc_margin: float = 0.5
    """ERC loss: alpha of the hinges max(M[i, j] - alpha M[i, i], 0) (and the transposed one)."""

    router_dtype: str = "fp32"
    """Precision of the router logits and scores: `fp32` or `fp64`."""

    dispatcher: str = "alltoall"
    """Token dispatcher across expert-parallel ranks: `alltoall` (sends each token only to the
    ranks of its experts) or `allgather` (every rank receives all tokens; routing-independent
    volume, for small expert-parallel groups or many experts per token)."""

    input_jitter_eps: Optional[float] = None
    """Training only: multiply the router's input by noise uniform in [1-eps, 1+eps] (Switch
    Transformer, arXiv 2101.03961; Megatron's `moe_input_jitter_eps`). None disables it."""

    init_method_std: float = 0.02
    """Std of the normal init used when no Megatron init method is given."""

    def __post_init__(self) -> None:
        _check_finite(self)
        _check_positive(self, "hidden_size", "num_experts", "ffn_hidden_size", "topk")
        _check_choice(self, "router_type", ROUTERS.names())
        _check_choice(self, "score_function", SCORE_FUNCTIONS)
        self._check_balancing()
        _check_choice(self, "drop_policy", DROP_POLICIES)
        _check_choice(self, "activation", ACTIVATIONS.names())
        _check_choice(self, "router_dtype", tuple(ROUTER_DTYPES))
        _check_choice(self, "dispatcher", DISPATCHERS.names())
        if self.topk > self.num_experts:
            raise ConfigError(
                f"topk={self.topk} exceeds num_experts={self.num_experts}; set topk <= num_experts"
            )
        if self.router_type == "top_p" and not 0.0 < self.top_p_threshold <= 1.0:
            raise ConfigError(
                f"top_p_threshold={self.top_p_threshold} is outside (0, 1]; pick e.g. 0.4"
            )
        if self.router_type == "top_p" and self.score_function != "softmax":
            raise ConfigError(
                f"score_function={self.score_function!r} with router_type='top_p': top-p needs a "
                "probability distribution; set score_function='softmax'"
            )
        if self.router_type == "top_p" and self.num_groups is not None:
            raise ConfigError(
                f"num_groups={self.num_groups} with router_type='top_p': group limits apply to "
                "the topk router only; unset num_groups"
            )
        self._check_groups()
        self._check_new_routers()
        if self.input_jitter_eps is not None and not 0.0 < self.input_jitter_eps < 1.0:
            raise ConfigError(
                f"input_jitter_eps={self.input_jitter_eps} is outside (0, 1); use e.g. 1e-2 or None"
            )
        if not self.init_method_std > 0:
            raise ConfigError(f"init_method_std={self.init_method_std} must be > 0; use e.g. 0.02")
        for name in ("z_loss_coeff", "entropy_loss_coeff", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} is negative; use a value >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(
                f"capacity_factor={self.capacity_factor} must be > 0; use None for dropless"
            )
        if self.topk_scaling_factor is not None and self.topk_scaling_factor <= 0:
            raise ConfigError(
                f"topk_scaling_factor={self.topk_scaling_factor} must be > 0; use None to disable"
            )
        if self.shared_expert_ffn_size is not None and self.shared_expert_ffn_size <= 0:
            raise ConfigError(
                f"shared_expert_ffn_size={self.shared_expert_ffn_size} must be > 0; use None for "
                "no shared expert"
            )
        if self.shared_expert_gate and self.shared_expert_ffn_size is None:
            raise ConfigError(
                "shared_expert_gate=True without a shared expert; set shared_expert_ffn_size"
            )

    def _check_new_routers(self) -> None:
        kind = self.router_type
        if kind in ("threshold", "base") and self.score_function != "sigmoid":
            raise ConfigError(
                f"score_function={self.score_function!r} with router_type={kind!r}: its gates are "
                "sigmoid(logit); set score_function='sigmoid'"
            )
        if kind == "sinkhorn" and self.score_function != "softmax":
            raise ConfigError(
                f"score_function={self.score_function!r} with router_type='sinkhorn': its gates "
                "come from the transport plan of exp(logits); set score_function='softmax'"
            )
        if kind in ("threshold", "sinkhorn", "base") and self.num_groups is not None:
            raise ConfigError(
                f"num_groups={self.num_groups} with router_type={kind!r}: group limits apply to "
                "the topk router only; unset num_groups"
            )
        if kind == "base" and self.topk != 1:
            raise ConfigError(f"topk={self.topk} with router_type='base': BASE layers send each "
                              "token to one expert; set topk=1")
        if kind in ("threshold", "sinkhorn", "base") and self.uses_expert_bias:
            raise ConfigError(
                f"balancing includes 'bias' with router_type={kind!r}, which balances by "
                "construction; drop 'bias' from balancing"
            )
        for name in ("threshold_ema_decay", "adaptive_aux_decay"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name}={getattr(self, name)} is outside [0, 1); use e.g. 0.99")
        if self.threshold_capacity is not None and not 0.0 <= self.threshold_capacity < 1.0:
            raise ConfigError(f"threshold_capacity={self.threshold_capacity} is outside [0, 1); "
                              "use e.g. 0.5, or None for no bounds")
        if self.threshold_warmup_steps < 0 or self.sinkhorn_max_iterations < 1:
            raise ConfigError(
                f"threshold_warmup_steps={self.threshold_warmup_steps}, sinkhorn_max_iterations="
                f"{self.sinkhorn_max_iterations}: use >= 0 and >= 1"
            )
        if self.gate_logit_norm is not None and self.gate_logit_norm <= 0:
            raise ConfigError(f"gate_logit_norm={self.gate_logit_norm} must be > 0; use None to "
                              "disable it")
        for name in ("sinkhorn_tolerance", "adaptive_aux_sensitivity", "erc_loss_coeff",
                     "erc_margin"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} is negative; use a value >= 0")
        if not 0.0 <= self.erc_noise < 1.0:
            raise ConfigError(f"erc_noise={self.erc_noise} is outside [0, 1); use e.g. 0.1")

    @property
    def uses_adaptive_aux(self) -> bool:
        """True when the router keeps Skywork-MoE's adaptive aux-loss coefficient."""
        return ADAPTIVE_AUX in self.balancing_kinds

    def _check_balancing(self) -> None:
        kinds = self.balancing_kinds
        for kind in kinds:
            if kind not in BALANCING:
                raise ConfigError(f"balancing={kind!r} is not one of {list(BALANCING)}")
        if len(set(kinds)) != len(kinds) or ("none" in kinds and len(kinds) > 1) or not kinds:
            raise ConfigError(
                f"balancing={self.balancing!r}: list each method once, and 'none' only alone"
            )
        losses = [k for k in kinds if k in BALANCE_LOSSES]
        coeffs = self.aux_loss_coeff
        if isinstance(coeffs, (list, tuple)):
            if len(coeffs) != len(losses):
                raise ConfigError(
                    f"aux_loss_coeff={list(coeffs)} has {len(coeffs)} values for the "
                    f"{len(losses)} losses {losses} in balancing; give one value per loss"
                )
        else:
            coeffs = [coeffs]
        for value in coeffs:
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"aux_loss_coeff={value!r} is negative; use a value >= 0")

    @property
    def balancing_kinds(self) -> tuple[str, ...]:
        """`balancing` as a tuple of method names."""
        kinds = self.balancing
        return (kinds,) if isinstance(kinds, str) else tuple(kinds)

    @property
    def uses_expert_bias(self) -> bool:
        """True when the router keeps a loss-free balancing bias."""
        return BIAS in self.balancing_kinds

    @property
    def balance_loss_coeffs(self) -> dict[str, float]:
        """{load-balancing loss name: weight}, only losses with a weight > 0."""
        losses = [k for k in self.balancing_kinds if k in BALANCE_LOSSES]
        coeffs = self.aux_loss_coeff
        coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(losses)
        return {k: float(c) for k, c in zip(losses, coeffs) if c > 0 or k == ADAPTIVE_AUX}

    def _check_groups(self) -> None:
        if (self.num_groups is None) != (self.groups_per_token is None):
            raise ConfigError(
                f"num_groups={self.num_groups}, groups_per_token={self.groups_per_token}: "
                "group-limited routing needs both set (or both None)"
            )
        if self.num_groups is None:
            return
        if self.num_groups <= 0 or self.num_experts % self.num_groups:
            raise ConfigError(
                f"num_groups={self.num_groups} does not divide num_experts={self.num_experts}; "
                "pick a divisor of num_experts"
            )
        if not 0 < self.groups_per_token <= self.num_groups:
            raise ConfigError(
                f"groups_per_token={self.groups_per_token} must be in 1..num_groups="
                f"{self.num_groups}"
            )
        if self.group_score_topk is None and self.topk % self.groups_per_token:
            raise ConfigError(
                f"topk={self.topk} is not a multiple of groups_per_token={self.groups_per_token}; "
                "a group is scored by its best topk/groups_per_token experts unless "
                "group_score_topk says how many"
            )
        experts_per_group = self.num_experts // self.num_groups
        if self.group_score_topk is not None and not (
                0 < self.group_score_topk <= experts_per_group):
            raise ConfigError(
                f"group_score_topk={self.group_score_topk} must be in 1..{experts_per_group} "
                "(the experts of one group)"
            )
        experts_in_chosen_groups = self.groups_per_token * self.num_experts // self.num_groups
        if self.topk > experts_in_chosen_groups:
            raise ConfigError(
                f"topk={self.topk} exceeds the {experts_in_chosen_groups} experts in "
                f"groups_per_token={self.groups_per_token} groups; raise groups_per_token"
            )

    @property
    def experts_scoring_a_group(self) -> int:
        """Group-limited routing: how many of a group's best expert scores add up to its
        score (`group_score_topk`, else topk / groups_per_token)."""
        return self.group_score_topk or self.topk // self.groups_per_token

    @property
    def torch_router_dtype(self) -> torch.dtype:
        return ROUTER_DTYPES[self.router_dtype]

    @property
    def gated(self) -> bool:
        """True when the expert MLP is a GLU (fc1 holds gate and up halves)."""
        return self.activation == "swiglu"

    def check_expert_parallel(self, ep_size: int) -> None:
        """Raise ConfigError unless the experts split evenly over `ep_size` ranks."""
        if self.num_experts % ep_size:
            raise ConfigError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel size "
                f"{ep_size}; choose an expert-parallel size that divides num_experts"
            )

    def replace(self, **changes: Any) -> "MoEConfig":
        """A validated copy with `changes` applied (unknown names raise ConfigError)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown MoEConfig field(s) {sorted(unknown)}; see megamoe.MoEConfig")
        return dataclasses.replace(self, **changes)


def moe_layer_pattern(config: Any, first_k_dense: int = 0) -> list[bool]:
    """Which layers are MoE: Megatron's `moe_layer_freq` (every n-th, or a 0/1 list of length
    num_layers), with the first `first_k_dense` layers forced dense (DeepSeek-V3 style)."""
    freq, n = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        if freq <= 0:
            raise ConfigError(f"moe_layer_freq={freq} must be >= 1")
        pattern = [i % freq == 0 for i in range(n)]
    else:
        if len(freq) != n or any(v not in (0, 1) for v in freq):
            raise ConfigError(
                f"moe_layer_freq={freq} must be a 0/1 list of length num_layers={n}"
            )
        pattern = [bool(v) for v in freq]
    if not 0 <= first_k_dense <= n:
        raise ConfigError(f"first_k_dense={first_k_dense} must be in 0..num_layers={n}")
    return [moe and i >= first_k_dense for i, moe in enumerate(pattern)]


def _check_finite(cfg: MoEConfig) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value} must be a finite number")


def _check_positive(cfg: MoEConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer")


def _check_choice(cfg: MoEConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}")
