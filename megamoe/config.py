"""MoEConfig: the settings of a megamoe layer, as a tree of sections owned by their components.

    MoEConfig
        hidden_size, num_experts, ffn_hidden_size, topk, init_method_std
        router:        RouterConfig, its class chosen by `router.kind` (ROUTERS): the common
                       gate settings here, each router's own in its module (e.g.
                       `megamoe.routing.threshold.ThresholdRouterConfig`)
        balancing:     BalancingConfig (loss-free bias, balance losses, z / ERC losses)
        dispatcher:    DispatcherConfig, `dispatcher.kind` from DISPATCHERS, capacity
        experts:       ExpertsConfig (the activation, biases)
        shared_expert: SharedExpertConfig

Every field declares whether it defines the model or how it is trained (`megamoe.settings`),
which is what a resumed run may change. Each section validates itself in `__post_init__`, first
holding its fields to their types as a YAML config is (`megamoe.settings.check_fields`: a tree
made in Python may give a section as a mapping of its settings, and `balancing` as a method name
or list of them, see `MoEConfig`); a check
that needs the rest of the layer (top-k against the experts, a router that balances by
construction) is the section's `check_in(moe)`, which `MoEConfig.__post_init__` calls, so the
layer never names a router kind. `MoEConfig.from_dict` builds the tree from plain data
(`megamoe.settings.build`); configs written before the tree (one flat list of 38 fields) are read
through `FLAT_NAMES` (`nest_flat_settings`). Megatron-Core's `moe_*` fields map onto the tree in
`megamoe.megatron.fields`. `moe_layer_pattern` says which layers of a model are MoE.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Union

import torch

from megamoe.errors import ConfigError
from megamoe.registry import ACTIVATIONS, DISPATCHERS, ROUTERS
from megamoe.settings import (build, check_choice, check_fields, deep_merge, model_setting,
                              resolve_kind, section, training_setting)

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
BIAS = "bias"
QUANTILE = "quantile"
ADAPTIVE_AUX = "adaptive_aux_loss"
BALANCE_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss", ADAPTIVE_AUX)
BALANCING = (BIAS, QUANTILE, *BALANCE_LOSSES, "none")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
GATED_ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclass
class RouterConfig:
    """Settings every router has; a router with settings of its own subclasses this beside its
    code and registers it (`@ROUTERS.register(name, config=...)`)."""

    kind: Optional[str] = model_setting(None)
    """The router (`megamoe.routing`): `topk`, `top_p` (dynamic top-p, Huang et al. ACL 2024),
    `threshold` (expert-threshold routing, arXiv 2603.11535), `sinkhorn` (balanced optimal
    transport), `base` (BASE layers, arXiv 2103.16716) or `hash` (a token-id table, Roller et
    al. arXiv 2106.04426, DeepSeek-V4's first layers). None: the one this class configures."""

    score_function: str = model_setting("softmax")
    """Router scores: `softmax`, `sigmoid`, or `sqrtsoftplus`, sqrt(softplus(logit)) (DeepSeek-V4;
    Megatron-Core 0.19's `moe_router_score_function`), which like sigmoid scores each expert on
    its own and is renormalised over the chosen ones."""

    pre_softmax: bool = model_setting(False)
    """softmax only: gates are the softmax over all experts (True) or renormalised over the chosen
    ones, i.e. softmax after selection (False)."""

    topk_scaling_factor: Optional[float] = model_setting(None)
    """Multiplier on the gate weights (DeepSeek-V3 uses 2.5); None leaves them unscaled."""

    gate_logit_norm: Optional[float] = model_setting(None)
    """Skywork-MoE gating-logit normalisation (arXiv 2406.06563): z <- lambda * (z - mean(z)) /
    std(z) per token before the score function, with lambda this value. None disables it."""

    bias: bool = model_setting(False)
    """The router's linear layer has a bias, logits = x W^T + b (GPT-OSS's `router.bias`;
    Megatron-Core's router under `add_bias_linear`)."""

    dtype: str = training_setting("fp32")
    """Precision of the router logits and scores: `fp32` or `fp64`."""

    replay: bool = training_setting(False)
    """Routing replay (R3, arXiv 2510.11370; Megatron's `moe_enable_routing_replay`): the router
    records its top-k choices or replays given ones, driven through Megatron-Core's
    `RouterReplay` (`megamoe.routing.replay`). Top-k router only."""

    input_jitter_eps: Optional[float] = training_setting(None)
    """Training only: multiply the router's input by noise uniform in [1-eps, 1+eps] (Switch
    Transformer, arXiv 2101.03961; Megatron's `moe_input_jitter_eps`). None disables it."""

    def __post_init__(self) -> None:
        check_fields(self, "router")
        resolve_kind(self, ROUTERS)
        _check_finite(self, "router")
        check_choice("router.score_function", self.score_function, SCORE_FUNCTIONS)
        check_choice("router.dtype", self.dtype, tuple(ROUTER_DTYPES))
        if self.topk_scaling_factor is not None and self.topk_scaling_factor <= 0:
            raise ConfigError(f"router.topk_scaling_factor={self.topk_scaling_factor} must be "
                              "> 0; use None to disable it")
        if self.gate_logit_norm is not None and self.gate_logit_norm <= 0:
            raise ConfigError(f"router.gate_logit_norm={self.gate_logit_norm} must be > 0; use "
                              "None to disable it")
        if self.input_jitter_eps is not None and not 0.0 < self.input_jitter_eps < 1.0:
            raise ConfigError(f"router.input_jitter_eps={self.input_jitter_eps} is outside "
                              "(0, 1); use e.g. 1e-2 or None")

    takes_quantile_balancing: ClassVar[bool] = False
    """Whether this router selects by quantile balancing's bias (`balancing.methods: quantile`):
    the top-k router does."""

    takes_replay: ClassVar[bool] = False
    """Whether this router records and replays its choices (`replay`): the top-k router does."""

    takes_zero_experts: ClassVar[bool] = False
    """Whether this router chooses among zero-computation experts too: the top-k router does."""

    def check_in(self, moe: "MoEConfig") -> None:
        """Checks against the rest of the layer (`MoEConfig.__post_init__` calls it)."""
        if moe.balancing.uses_quantile and not self.takes_quantile_balancing:
            raise ConfigError(f"balancing.methods=quantile with router.kind={self.kind!r}: "
                              "quantile balancing picks each token's top-k experts; use "
                              "router.kind=topk")
        if moe.experts.zero_experts and not self.takes_zero_experts:
            raise ConfigError(f"experts.zero_experts={moe.experts.zero_experts} with router.kind="
                              f"{self.kind!r}: identity experts are chosen in a top-k; use "
                              "router.kind=topk")
        if self.replay and not self.takes_replay:
            raise ConfigError(f"router.replay=True with router.kind={self.kind!r}: routing "
                              "replay records and replays a fixed top-k; use router.kind=topk")

    @property
    def torch_dtype(self) -> torch.dtype:
        return ROUTER_DTYPES[self.dtype]

    def require_score_function(self, function: str, why: str) -> None:
        """Refuse a score function other than `function` (`why`: where this router's gates come
        from)."""
        if self.score_function != function:
            raise ConfigError(f"router.score_function={self.score_function!r} with router.kind="
                              f"{self.kind!r}: {why}; set router.score_function={function!r}")


@dataclass
class BalancingConfig:
    """How the load is balanced over the experts: loss-free bias, balance losses, and the
    router's z-loss and ERC loss."""

    methods: Union[str, list[str]] = model_setting("aux_loss")
    """One of, or a list combining: `bias` (loss-free balancing, arXiv 2408.15664), `aux_loss`
    (Switch loss, arXiv 2101.03961, counts over the micro-batch's whole sequences),
    `global_aux_loss` (Switch loss with counts over every replica of the router, averaged over
    the step's micro-batches, arXiv 2501.11873), `seq_aux_loss` (per sequence, DeepSeek-V2,
    arXiv 2405.04434), `adaptive_aux_loss` (the Switch loss with Skywork-MoE's per-layer
    coefficient adapted to the layer's token-drop rate, arXiv 2406.06563; its `aux_loss_coeff`
    is the starting value), `quantile` (quantile balancing, Kimi K3, Megatron-Core's
    `quantile_balancing`: a bias solved from the routing scores' quantiles, no step size; alone,
    on the top-k router without groups), or `none`. DeepSeek-V3's recipe is [bias, seq_aux_loss]
    with aux_loss_coeff 1e-4. A model setting: `bias` and `quantile` add a routing buffer to the
    model."""

    aux_loss_coeff: Union[float, list[float]] = training_setting(1e-2)
    """Weight of the load-balancing losses in `methods`: one value for all of them, or a list
    with one value per loss, in the order of `methods` (`bias` and `none` take none), as
    Megatron's `moe_aux_loss_coeff` list."""

    bias_update_rate: float = training_setting(1e-3)
    """Loss-free balancing: step u of `bias += u * sign(mean(c) - c)`."""

    bias_update_schedule: list[tuple[int, float]] = training_setting(default_factory=list)
    """Loss-free balancing: [step, rate] pairs, each rate taking over from its step on (steps
    increasing); before the first, `bias_update_rate`. DeepSeek-V3 (arXiv 2412.19437, §4.2)
    ran 0.001 and then 0.0 for its last 500B tokens: [[N, 0.0]]."""

    bias_mean_centering: bool = training_setting(False)
    """Loss-free balancing: subtract the mean of each update so mean(bias) stays 0."""

    quantile_ema: float = training_setting(0.0)
    """Quantile balancing: the bias becomes ema * bias + (1 - ema) * the step's quantile estimate
    (Megatron's `moe_router_quantile_balancing_ema`); 0 replaces it every step."""

    z_loss_coeff: float = training_setting(0.0)
    """Weight of the router z-loss (ST-MoE, arXiv 2202.08906); 0 disables it."""

    adaptive_aux_decay: float = training_setting(0.99)
    """`adaptive_aux_loss`: beta of Skywork-MoE's coefficient update alpha <- beta * alpha +
    (1 - beta) * xi * d, d the layer's token-drop rate of the step."""

    adaptive_aux_sensitivity: float = training_setting(0.1)
    """`adaptive_aux_loss`: xi of that update (the coefficient a drop rate of 100% would settle
    at). The drop rate is measured at `dispatcher.capacity_factor`, or, dropless, as the share of
    assignments above capacity factor 1."""

    erc_loss_coeff: float = training_setting(0.0)
    """Weight of the expert-router coupling loss (arXiv 2512.23447, any router); 0 disables it."""

    erc_noise: float = training_setting(0.1)
    """ERC loss: proxy tokens are the router rows times noise uniform in [1 - eps, 1 + eps]."""

    erc_margin: float = training_setting(0.5)
    """ERC loss: alpha of the hinges max(M[i, j] - alpha M[i, i], 0) (and the transposed one)."""

    def __post_init__(self) -> None:
        check_fields(self, "balancing")
        _check_finite(self, "balancing")
        kinds = self.kinds
        for kind in kinds:
            check_choice("balancing.methods", kind, BALANCING)
        if len(set(kinds)) != len(kinds) or ("none" in kinds and len(kinds) > 1) or not kinds:
            raise ConfigError(f"balancing.methods={self.methods!r}: list each method once, and "
                              "'none' only alone")
        if QUANTILE in kinds and len(kinds) > 1:
            raise ConfigError(f"balancing.methods={self.methods!r}: quantile balancing sets the "
                              "load by its bias alone (no aux loss, no loss-free bias, as in "
                              "Megatron-Core); list 'quantile' alone")
        losses = self.losses
        coeffs = self.aux_loss_coeff
        if isinstance(coeffs, (list, tuple)):
            if len(coeffs) != len(losses):
                raise ConfigError(
                    f"balancing.aux_loss_coeff={list(coeffs)} has {len(coeffs)} values for the "
                    f"{len(losses)} losses {losses} in balancing.methods; give one per loss")
        else:
            coeffs = [coeffs]
        for value in coeffs:
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"balancing.aux_loss_coeff={value!r} is negative; use a "
                                  "value >= 0")
        for name in ("bias_update_rate", "z_loss_coeff", "adaptive_aux_sensitivity",
                     "erc_loss_coeff", "erc_margin"):
            if getattr(self, name) < 0:
                raise ConfigError(f"balancing.{name}={getattr(self, name)} is negative; use a "
                                  "value >= 0")
        if not 0.0 <= self.quantile_ema < 1.0:
            raise ConfigError(f"balancing.quantile_ema={self.quantile_ema} is outside [0, 1); "
                              "use 0.0 (Megatron's default) or e.g. 0.9")
        if not 0.0 <= self.adaptive_aux_decay < 1.0:
            raise ConfigError(f"balancing.adaptive_aux_decay={self.adaptive_aux_decay} is "
                              "outside [0, 1); use e.g. 0.99")
        if not 0.0 <= self.erc_noise < 1.0:
            raise ConfigError(f"balancing.erc_noise={self.erc_noise} is outside [0, 1); use "
                              "e.g. 0.1")
        self._check_schedule()

    SHORTHAND: ClassVar[str] = "a method name or a list of them (balancing.methods)"

    @classmethod
    def from_shorthand(cls, value: Any) -> Optional["BalancingConfig"]:
        """`balancing=["bias", "aux_loss"]` (or one name, `balancing="bias"`) for
        `BalancingConfig(methods=...)`, the other settings at their defaults; None when `value`
        is no such name or list (`megamoe.settings.read_section`)."""
        if isinstance(value, str):
            return cls(methods=value)
        if (isinstance(value, (list, tuple)) and value
                and all(isinstance(name, str) for name in value)):
            return cls(methods=list(value))
        return None

    def _check_schedule(self) -> None:
        # Lists, not tuples, so the config dumps as plain YAML.
        self.bias_update_schedule = [list(pair) for pair in self.bias_update_schedule]
        steps = [step for step, _ in self.bias_update_schedule]
        rates = [rate for _, rate in self.bias_update_schedule]
        if (any(step < 0 for step in steps) or steps != sorted(set(steps))
                or any(not math.isfinite(rate) or rate < 0 for rate in rates)):
            raise ConfigError(f"balancing.bias_update_schedule={self.bias_update_schedule}: give "
                              "[step, rate] pairs with increasing steps >= 0 and rates >= 0, "
                              "e.g. [[9000, 0.0]]")

    @property
    def kinds(self) -> tuple[str, ...]:
        """`methods` as a tuple of method names."""
        methods = self.methods
        return (methods,) if isinstance(methods, str) else tuple(methods)

    @property
    def losses(self) -> list[str]:
        """The balance losses among `methods`, in order."""
        return [kind for kind in self.kinds if kind in BALANCE_LOSSES]

    @property
    def uses_expert_bias(self) -> bool:
        """True when the router keeps a loss-free balancing bias."""
        return BIAS in self.kinds

    @property
    def uses_quantile(self) -> bool:
        """True when the router keeps a quantile-balancing bias."""
        return QUANTILE in self.kinds

    @property
    def uses_adaptive_aux(self) -> bool:
        """True when the router keeps Skywork-MoE's adaptive aux-loss coefficient."""
        return ADAPTIVE_AUX in self.kinds

    @property
    def loss_coeffs(self) -> dict[str, float]:
        """{load-balancing loss name: weight}, only losses with a weight > 0."""
        losses, coeffs = self.losses, self.aux_loss_coeff
        coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(losses)
        return {k: float(c) for k, c in zip(losses, coeffs) if c > 0 or k == ADAPTIVE_AUX}

    def bias_update_rate_at(self, step: int) -> float:
        """The bias update rate of optimizer step `step` (`bias_update_schedule`)."""
        rate = self.bias_update_rate
        for start, scheduled in self.bias_update_schedule:
            if step >= start:
                rate = scheduled
        return rate


@dataclass
class DispatcherConfig:
    """How tokens reach their experts' ranks, and how many an expert takes."""

    kind: str = training_setting("alltoall")
    """Token dispatcher across expert-parallel ranks: `alltoall` (sends each token only to the
    ranks of its experts) or `allgather` (every rank receives all tokens; routing-independent
    volume, for small expert-parallel groups or many experts per token)."""

    capacity_factor: Optional[float] = training_setting(None)
    """Per-expert capacity = ceil(capacity_factor * routed assignments / E), counted per forward
    call (per rank). None means dropless."""

    drop_policy: str = training_setting("probs")
    """Which tokens an over-full expert keeps: highest gate (`probs`) or earliest (`position`)."""

    def __post_init__(self) -> None:
        check_fields(self, "dispatcher")
        resolve_kind(self, DISPATCHERS)
        _check_finite(self, "dispatcher")
        check_choice("dispatcher.drop_policy", self.drop_policy, DROP_POLICIES)
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"dispatcher.capacity_factor={self.capacity_factor} must be > 0; "
                              "use None for dropless")

    def check_in(self, moe: "MoEConfig") -> None:
        """Checks against the rest of the layer (none for the built-in dispatchers)."""


@dataclass
class ExpertsConfig:
    """The routed experts' MLP."""

    activation: str = model_setting("swiglu")
    """Expert activation: `swiglu` (GLU with SiLU), `clamped_swiglu` (GPT-OSS's GLU: gate and
    up clamped at `swiglu_limit`, (up + 1) * gate * sigmoid(1.702 gate)), `gelu` or
    `squared_relu`."""

    swiglu_limit: float = model_setting(7.0)
    """`clamped_swiglu` only: the clamp, gate <= limit and -limit <= up <= limit (GPT-OSS's
    `swiglu_limit`, 7.0; Megatron-Core's `activation_func_clamp_value`)."""

    bias: bool = model_setting(False)
    """Each expert's fc1 and fc2 have a bias (GPT-OSS's `gate_up_proj_bias`, `down_proj_bias`;
    Megatron-Core's experts under `add_bias_linear`), and so do the latent projections."""

    latent_size: Optional[int] = model_setting(None)
    """Latent MoE (Nemotron 3; Megatron-Core's `moe_latent_size`): the routed experts compute in
    this width, below the hidden size. Each token is projected down once (`fc1_latent_proj`),
    dispatched and computed in latent width, and the combined output projected up
    (`fc2_latent_proj`); the router and the shared expert see the full width. None: no
    projections."""

    zero_experts: int = model_setting(0)
    """Zero-computation experts (LongCat-Flash, arXiv 2509.01322): this many identity experts
    beside the `num_experts` real ones. The router chooses its top-k among all of them; a token
    routed to identity experts gets its own hidden state times their summed gates, with no GEMM,
    no dispatch and no capacity, so the compute per token varies. Top-k router only."""

    real_experts_per_token: Optional[float] = training_setting(None)
    """With zero experts and `balancing.methods: bias`, the compute budget: the mean number of
    real experts per token the bias steers towards (LongCat-Flash: 8 of its top-12). None: topk
    x num_experts / (num_experts + zero_experts), every slot equally loaded."""

    def __post_init__(self) -> None:
        check_fields(self, "experts")
        _check_finite(self, "experts")
        check_choice("experts.activation", self.activation, ACTIVATIONS.names())
        if self.swiglu_limit <= 0:
            raise ConfigError(f"experts.swiglu_limit={self.swiglu_limit} must be > 0; GPT-OSS "
                              "uses 7.0")

    def check_in(self, moe: "MoEConfig") -> None:
        """A latent width is below the layer's hidden size; zero experts and their budget
        leave room for real and identity choices, under the balancing that can steer them."""
        if self.latent_size is not None and not 0 < self.latent_size < moe.hidden_size:
            raise ConfigError(f"experts.latent_size={self.latent_size} must be in 1.."
                              f"{moe.hidden_size - 1} (below hidden_size={moe.hidden_size}); "
                              "use None for experts at full width")
        if not isinstance(self.zero_experts, int) or self.zero_experts < 0:
            raise ConfigError(f"experts.zero_experts={self.zero_experts!r} must be a whole "
                              "number >= 0")
        if self.real_experts_per_token is not None and not (
                self.zero_experts and 0 < self.real_experts_per_token <= moe.topk):
            raise ConfigError(f"experts.real_experts_per_token={self.real_experts_per_token} "
                              f"needs experts.zero_experts > 0 and a value in (0, topk="
                              f"{moe.topk}]; leave it unset otherwise")
        if self.zero_experts and moe.balancing.bias_mean_centering:
            raise ConfigError(f"experts.zero_experts={self.zero_experts} with balancing."
                              "bias_mean_centering=True: centring would cancel the compute "
                              "budget's steering; set bias_mean_centering=false")
        if self.zero_experts and moe.balancing.uses_quantile:
            raise ConfigError(f"experts.zero_experts={self.zero_experts} with balancing.methods="
                              "quantile: quantile balancing would give identity and real "
                              "experts equal loads; use 'bias' (LongCat's budget control)")

    @property
    def gated(self) -> bool:
        """True when the expert MLP is a GLU (fc1 holds gate and up halves)."""
        return self.activation in GATED_ACTIVATIONS


@dataclass
class SharedExpertConfig:
    """The always-on shared expert (DeepSeekMoE, arXiv 2401.06066)."""

    ffn_hidden_size: Optional[int] = model_setting(None)
    """Its intermediate size; None means no shared expert."""

    gate: bool = model_setting(False)
    """Scale the shared expert's output by sigmoid(x . w_gate) (Qwen2-MoE)."""

    def __post_init__(self) -> None:
        check_fields(self, "shared_expert")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ConfigError(f"shared_expert.ffn_hidden_size={self.ffn_hidden_size} must be "
                              "> 0; use None for no shared expert")
        if self.gate and self.ffn_hidden_size is None:
            raise ConfigError("shared_expert.gate=True without a shared expert; set "
                              "shared_expert.ffn_hidden_size")


@dataclass
class MoEConfig:
    """Every setting of a megamoe layer (see the module docstring for the tree).

    Made in Python, each setting is held to the type a YAML config is
    (`megamoe.settings.check_fields`): `topk="2"`, `topk=True` or a list where a number belongs
    is a ConfigError naming the setting (an int where a float belongs is fine). Each section
    (`router`, `balancing`, `dispatcher`, `experts`, `shared_expert`) takes its settings object
    (`BalancingConfig(methods=["bias"], bias_update_rate=1e-2)`, `ThresholdRouterConfig()`), or
    a mapping of its settings read as a config file's (`router={"kind": "threshold",
    "ema_decay": 0.9}`); anything else, such as `router="topk"`, is refused. `balancing` also
    takes the shorthand of a method name or a list of them, read as `balancing.methods` with the
    other balancing settings at their defaults:

        MoEConfig(hidden_size=512, num_experts=8, ffn_hidden_size=1024, topk=2,
                  balancing=["bias", "aux_loss"])
        # == ... balancing=BalancingConfig(methods=["bias", "aux_loss"])
    """

    hidden_size: int = model_setting()
    """Model hidden size H (the layer's input and output width)."""

    num_experts: int = model_setting()
    """Number of routed experts E in this layer."""

    ffn_hidden_size: int = model_setting()
    """Intermediate size of one routed expert (per GLU half for swiglu)."""

    topk: int = model_setting(2)
    """Experts per token for the `topk` router; also the nominal K of capacity planning."""

    init_method_std: float = training_setting(0.02)
    """Std of the normal init used when no Megatron init method is given (initialisation only)."""

    router: RouterConfig = section(lambda: ROUTERS.config_class("topk")(), kinds=ROUTERS)
    balancing: BalancingConfig = section(BalancingConfig)
    dispatcher: DispatcherConfig = section(DispatcherConfig, kinds=DISPATCHERS)
    experts: ExpertsConfig = section(ExpertsConfig)
    shared_expert: SharedExpertConfig = section(SharedExpertConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("hidden_size", "num_experts", "ffn_hidden_size", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.topk > self.num_experts + self.experts.zero_experts:
            raise ConfigError(f"topk={self.topk} exceeds num_experts={self.num_experts} (plus "
                              f"{self.experts.zero_experts} zero experts); set topk <= "
                              "num_experts")
        if not (math.isfinite(self.init_method_std) and self.init_method_std > 0):
            raise ConfigError(f"init_method_std={self.init_method_std} must be > 0; use e.g. "
                              "0.02")
        for name in ("router", "balancing", "dispatcher", "experts", "shared_expert"):
            part = getattr(self, name)
            check_in = getattr(part, "check_in", None)
            if check_in is not None:
                check_in(self)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "in the MoE settings") -> "MoEConfig":
        """The tree from nested plain data (`megamoe.settings.build`), e.g.
        {"hidden_size": 64, "num_experts": 8, "ffn_hidden_size": 128,
         "router": {"kind": "threshold", "ema_decay": 0.9}}."""
        return build(cls, raw, "moe", where)

    def to_dict(self) -> dict:
        """Nested plain data that `from_dict` reads back to an equal config."""
        return dataclasses.asdict(self)

    def merged(self, changes: dict, where: str = "in the MoE settings") -> "MoEConfig":
        """A validated copy with nested `changes` applied (`megamoe.settings.deep_merge`: a
        router of another kind replaces the router section)."""
        return type(self).from_dict(deep_merge(self.to_dict(), changes), where)

    @property
    def router_width(self) -> int:
        """The choices a router scores: the real experts, then the zero experts."""
        return self.num_experts + self.experts.zero_experts

    @property
    def real_experts_per_token(self) -> float:
        """The compute budget of zero-expert layers' bias (`experts.real_experts_per_token`,
        by default the share of real slots); topk without zero experts."""
        if not self.experts.zero_experts:
            return float(self.topk)
        return self.experts.real_experts_per_token or \
            self.topk * self.num_experts / self.router_width

    @property
    def expert_width(self) -> int:
        """The width the routed experts compute in and the dispatcher moves: the latent size,
        else the hidden size."""
        return self.experts.latent_size or self.hidden_size

    def check_expert_parallel(self, ep_size: int) -> None:
        """Raise ConfigError unless the experts split evenly over `ep_size` ranks."""
        if self.num_experts % ep_size:
            raise ConfigError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel size "
                f"{ep_size}; choose an expert-parallel size that divides num_experts")


FLAT_NAMES = {
    "router_type": "router.kind", "score_function": "router.score_function",
    "pre_softmax": "router.pre_softmax", "topk_scaling_factor": "router.topk_scaling_factor",
    "gate_logit_norm": "router.gate_logit_norm", "router_dtype": "router.dtype",
    "input_jitter_eps": "router.input_jitter_eps", "num_groups": "router.num_groups",
    "groups_per_token": "router.groups_per_token",
    "group_score_topk": "router.group_score_topk", "top_p_threshold": "router.threshold",
    "entropy_loss_coeff": "router.entropy_loss_coeff",
    "threshold_ema_decay": "router.ema_decay", "threshold_warmup_steps": "router.warmup_steps",
    "threshold_capacity": "router.capacity", "sinkhorn_tolerance": "router.tolerance",
    "sinkhorn_max_iterations": "router.max_iterations", "balancing": "balancing.methods",
    "aux_loss_coeff": "balancing.aux_loss_coeff",
    "bias_update_rate": "balancing.bias_update_rate",
    "bias_mean_centering": "balancing.bias_mean_centering",
    "z_loss_coeff": "balancing.z_loss_coeff",
    "adaptive_aux_decay": "balancing.adaptive_aux_decay",
    "adaptive_aux_sensitivity": "balancing.adaptive_aux_sensitivity",
    "erc_loss_coeff": "balancing.erc_loss_coeff", "erc_noise": "balancing.erc_noise",
    "erc_margin": "balancing.erc_margin", "dispatcher": "dispatcher.kind",
    "capacity_factor": "dispatcher.capacity_factor", "drop_policy": "dispatcher.drop_policy",
    "activation": "experts.activation",
    "shared_expert_ffn_size": "shared_expert.ffn_hidden_size",
    "shared_expert_gate": "shared_expert.gate",
}
"""The flat MoE settings of configs and checkpoints written before the tree -> their place in
it. (`balancing` and `dispatcher` are flat only when their value is not a mapping.)"""


def is_flat_setting(key: str, value: Any) -> bool:
    """Whether `key: value` is a setting in the flat form of older configs."""
    return key in FLAT_NAMES and not (key in ("balancing", "dispatcher")
                                      and isinstance(value, dict))


def nest_flat_settings(raw: dict, note: Optional[Callable[[str, str], None]] = None) -> dict:
    """`raw` (MoE settings as plain data) with every flat setting of an older config moved to its
    place in the tree; `note(old, new)` is called for each. A setting given both ways is an
    error unless the two agree."""
    nested = {key: value for key, value in raw.items() if not is_flat_setting(key, value)}
    for key, value in raw.items():
        if not is_flat_setting(key, value):
            continue
        section_name, name = FLAT_NAMES[key].split(".")
        part = nested.get(section_name, {})
        if not isinstance(part, dict):
            raise ConfigError(f"moe.{section_name} must be a mapping of settings, not "
                              f"{part!r:.60}")
        if name in part and part[name] != value:
            raise ConfigError(f"moe.{key}={value!r:.60} and moe.{FLAT_NAMES[key]}="
                              f"{part[name]!r:.60} disagree; moe.{key} is the older name of "
                              f"moe.{FLAT_NAMES[key]}: keep only one")
        nested[section_name] = {**part, name: value}
        if note is not None:
            note(key, FLAT_NAMES[key])
    return nested


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


def _check_finite(settings: Any, prefix: str) -> None:
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{f.name}={value} must be a finite number")
