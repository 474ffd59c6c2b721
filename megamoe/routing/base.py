"""The router interface: logits -> `Routing`, shared by every routing method.

Shape legend: T tokens, D hidden size, E experts.
A router never assumes a fixed number of experts per token: its selection is a boolean map
`selected_TE` whose row sums may vary (dynamic top-p), with gate weights `gates_TE` that are zero
off the map.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from megamoe.balancing.inference import InferenceTally
from megamoe.balancing.owner import StepOwner
from megamoe.balancing.tracker import LoadTracker
from megamoe.config import MoEConfig, RouterConfig
from megamoe.errors import ConfigError, DataError
from megamoe.parallel.comm import Comm, SingleComm


@dataclass(frozen=True)
class Routing:
    """What a router decided for one batch of tokens.

    selected_TE: experts chosen by the router (bias and group limits applied), bool.
    routing_map_TE: experts the tokens are actually sent to (selected minus capacity drops).
    gates_TE: weights that multiply each expert's output, zero off `routing_map_TE`.
    probs_TE: the router's distribution over experts (softmax, or sigmoid normalised per token),
        the P of the balance losses.
    logits_TE: raw router logits (z-loss).
    tokens_T: the tokens that are not padding (bool), or None for all; a real token may be
        routed to no expert (expert-threshold routing).
    """

    selected_TE: torch.Tensor
    routing_map_TE: torch.Tensor
    gates_TE: torch.Tensor
    probs_TE: torch.Tensor
    logits_TE: torch.Tensor
    tokens_T: Optional[torch.Tensor] = None

    def with_map(self, routing_map_TE: torch.Tensor) -> "Routing":
        """The same routing with a smaller dispatch map (gates zeroed off it)."""
        return replace(self, routing_map_TE=routing_map_TE,
                       gates_TE=self.gates_TE * routing_map_TE)


def refuse_expert_bias(router: RouterConfig, moe) -> None:
    """A router that balances by construction takes no loss-free bias."""
    if moe.balancing.uses_expert_bias:
        raise ConfigError(f"balancing.methods includes 'bias' with router.kind={router.kind!r}, "
                          "which balances by construction; drop 'bias' from balancing.methods")


def checked_expert_ids(ids_RK, rows: int, experts: int, topk: int, what: str, needs: str,
                       fix: str) -> torch.Tensor:
    """`ids_RK` as int64 if it is an integer [rows, topk] tensor of distinct experts below
    `experts` in each row (a replayed routing, a hash table); a one-line DataError naming `what`
    (and `needs`, who expects that shape) with `fix` otherwise."""
    if not isinstance(ids_RK, torch.Tensor) or ids_RK.is_floating_point() \
            or tuple(ids_RK.shape) != (rows, topk):
        wanted = f"where {needs} needs integer [{rows}, {topk}]"
        given = (f"shape {tuple(ids_RK.shape)} {wanted} (given {ids_RK.dtype})"
                 if isinstance(ids_RK, torch.Tensor) else f"a {type(ids_RK).__name__} {wanted}")
        raise DataError(f"{what} of {given}; {fix}")
    if ids_RK.numel() and (int(ids_RK.min()) < 0 or int(ids_RK.max()) >= experts):
        raise DataError(f"{what} names experts {int(ids_RK.min())} to {int(ids_RK.max())} where "
                        f"the layer has experts 0..{experts - 1}; {fix}")
    if topk > 1 and ids_RK.numel() and bool((ids_RK.sort(dim=1).values.diff(dim=1) == 0).any()):
        raise DataError(f"{what} gives a token an expert twice: each token needs {topk} distinct "
                        "experts, never the same expert twice")
    return ids_RK.long()


def in_recomputation() -> bool:
    """True while autograd's backward is running, i.e. during activation recomputation."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Linear router (with a bias under `router.bias`) and an optional loss-free balancing bias.

    Subclasses implement `select(scores_TE, logits_TE, real_T) -> (selected_TE, gates_TE)`,
    where `scores_TE` are the router probabilities and `real_T` (bool, or None for all) marks
    the tokens that are not padding. A router with state updated once per optimizer step
    (expert thresholds) implements `step_sums` and `end_step`, which `step_balancing` calls;
    one that changes the layer's output form (BASE) overrides `mix_output`. `group_comm` is the
    expert-parallel group (set by the MoE layer): routers that solve one assignment over the
    whole group's tokens (Sinkhorn, BASE) gather their logits over it. The expert bias (arXiv
    2408.15664) lives in the fp32 buffer `expert_bias`; it steers selection only and is updated
    once per optimizer step, never by gradients, by `megamoe.balancing.step_balancing`.

    Who ends each step is `step_owner` (`megamoe.balancing.owner`), decided when the model is
    built: here `step_balancing`, called by megamoe's trainer or a plain PyTorch loop. A host
    training framework that updates the bias itself (Megatron-Core's finalize_model_grads,
    `megamoe.megatron.router_counts`) sets another owner and extends `record` (count the
    routing for it too).
    """

    step_owner: StepOwner = StepOwner.STEP_BALANCING

    def __init__(self, cfg: MoEConfig, init_method=None):
        super().__init__()
        self.cfg = cfg
        E = cfg.router_width  # the real experts, then the zero-computation ones
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        (init_method or _normal_init(cfg.init_method_std))(self.weight)
        # router.bias (GPT-OSS): zeros, as Megatron's linear biases start.
        self.bias = nn.Parameter(torch.zeros(E)) if cfg.router.bias else None
        if cfg.balancing.uses_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        if cfg.balancing.uses_quantile:  # megamoe.balancing.quantile
            self.register_buffer("qb_beta", torch.zeros(E, dtype=torch.float32))
            self.register_buffer("quantile_sum", torch.zeros(E, dtype=torch.float32),
                                 persistent=False)
            self.register_buffer("quantile_batches", torch.zeros((), dtype=torch.long),
                                 persistent=False)
        if cfg.balancing.uses_adaptive_aux:  # Skywork-MoE's coefficient, balancing.adaptive
            self.register_buffer("adaptive_aux_coeff", torch.tensor(
                [cfg.balancing.loss_coeffs.get("adaptive_aux_loss", 0.0)], dtype=torch.float32))
        self.load = LoadTracker(cfg.num_experts)  # the real experts' loads
        # Set inside `megamoe.balancing.inference.tallying_inference_routing` only.
        self.inference_tally: Optional[InferenceTally] = None
        self.layer_number: Optional[int] = None
        self.group_comm: Comm = SingleComm()
        self.token_comm: Comm = SingleComm()
        # Routing replay's state (`router.replay`), set by the layer (`MoELayer.make_replay`).
        self.replay = None

    @property
    def bias_E(self) -> Optional[torch.Tensor]:
        """The experts' bias [E], or None without loss-free balancing."""
        return getattr(self, "expert_bias", None)

    @property
    def quantile_beta_E(self) -> Optional[torch.Tensor]:
        """Quantile balancing's bias [E] (subtracted from the logits), or None without it."""
        return getattr(self, "qb_beta", None)

    def add_quantile_estimate(self, estimate_E: torch.Tensor) -> None:
        """Count one micro-batch's quantile estimate towards the step's bias update."""
        self.quantile_sum += estimate_E
        self.quantile_batches += 1

    def forward(self, x_TD: torch.Tensor, padding_mask_T: Optional[torch.Tensor] = None) -> Routing:
        """Route tokens; padded tokens (padding_mask_T True) go to no expert and are not counted."""
        dtype = self.cfg.router.torch_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        logits_TE = F.linear(self.jitter(x_TD).to(dtype), self.weight.to(dtype), bias)
        if self.cfg.router.gate_logit_norm is not None:
            logits_TE = normalise_logits(logits_TE, self.cfg.router.gate_logit_norm)
        probs_TE = self.probabilities(logits_TE)
        real_T = None if padding_mask_T is None else ~padding_mask_T.reshape(-1)
        selected_TE, gates_TE = self.select(probs_TE, logits_TE, real_T)
        if padding_mask_T is not None:
            keep_T1 = ~padding_mask_T.reshape(-1, 1)
            selected_TE = selected_TE & keep_T1
            gates_TE = gates_TE * keep_T1
        tokens_T = real_T if real_T is not None else torch.ones(
            logits_TE.shape[0], dtype=torch.bool, device=logits_TE.device)
        return Routing(selected_TE, selected_TE, gates_TE, probs_TE, logits_TE, tokens_T)

    def jitter(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Training only: x * U(1 - eps, 1 + eps), the input jitter of the Switch Transformer
        (arXiv 2101.03961) as Megatron's `moe_input_jitter_eps` applies it to the router input."""
        eps = self.cfg.router.input_jitter_eps
        if eps is None or not self.training:
            return x_TD
        noise = torch.empty_like(x_TD).uniform_(1.0 - eps, 1.0 + eps)
        return x_TD * noise

    def probabilities(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """Softmax over experts, or per-expert scores, sigmoid or sqrt(softplus) (normalised per
        token for the balance loss)."""
        score_function = self.cfg.router.score_function
        if score_function == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        if score_function == "sqrtsoftplus":
            return torch.nn.functional.softplus(logits_TE).sqrt()
        return torch.sigmoid(logits_TE)

    def selection_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Scores that decide selection: the router scores plus the balancing bias, if any."""
        bias_E = self.bias_E
        if bias_E is None:
            return scores_TE.detach()
        return scores_TE.detach() + bias_E.to(scores_TE.dtype)

    def select(self, scores_TE: torch.Tensor, logits_TE: torch.Tensor,
               real_T: Optional[torch.Tensor] = None):
        raise NotImplementedError

    def loss_coeffs(self) -> dict[str, float]:
        """{name: weight} of the losses this router adds to the balance losses (its own
        settings'; none here), only those with a weight > 0."""
        return {}

    def own_losses(self, routing: Routing, num_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """This router's own unweighted losses (those named by `loss_coeffs`) of a routing of
        `num_tokens` real tokens over the token group."""
        return {}

    def mix_output(self, x_TD: torch.Tensor, y_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' combined output `y_TD` as the layer returns it (as is here)."""
        return y_TD

    has_step_state = False  # True for routers implementing step_sums / end_step
    needs_token_ids = False  # True for routers choosing by token id (`token_ids_T`, hash)

    def step_sums(self) -> Optional[torch.Tensor]:
        """Per-step routing state to sum over the replica group (fixed size), or None."""
        return None

    def end_step(self, summed: Optional[torch.Tensor]) -> None:
        """Once per optimizer step, with `step_sums` summed over the replica group."""

    def counts_this_forward(self) -> bool:
        """True for a kept training forward (not eval, not activation recomputation): the only
        forwards whose routing is counted."""
        return self.training and not in_recomputation()

    def record(self, routing: Routing, losses: dict[str, torch.Tensor]) -> None:
        """Count this routing and its (unweighted) balance losses for balancing and metrics, if
        it is a kept training forward."""
        if not self.counts_this_forward():
            return
        self.load.record(routing.selected_TE, routing.routing_map_TE, routing.probs_TE,
                         routing.tokens_T, losses)

    @torch.no_grad()
    def discard_step(self) -> None:
        """Forget this step's counts (a step abandoned before its update, e.g. rolled back)."""
        self.load.reset()
        self.reset_quantile_estimates()

    @torch.no_grad()
    def reset_quantile_estimates(self) -> None:
        """Forget the step's quantile estimates (after its update)."""
        if self.quantile_beta_E is not None:
            self.quantile_sum.zero_()
            self.quantile_batches.zero_()

    def step_pending(self) -> bool:
        """Counts of a finished step still wait for `megamoe.balancing.step_balancing`: this
        router has its own per-step state (expert thresholds), Skywork's adaptive coefficient,
        or an expert or quantile bias its step owner leaves to `step_balancing`."""
        if self.load.empty:
            return False
        biased = self.bias_E is not None or self.quantile_beta_E is not None
        return (self.has_step_state or getattr(self, "adaptive_aux_coeff", None) is not None
                or (biased and self.step_owner.bias_by_step_balancing))

    def _apply(self, fn, recurse=True):
        """Move the fp32 buffers with the module but keep them in fp32 (a bf16 cast would erase
        bias updates of size 1e-3 and round large token counts)."""
        names = [n for n in self.fp32_buffers if n in self._buffers]
        if not names:
            return super()._apply(fn, recurse)
        kept = {name: self._buffers[name] for name in names}
        for name in names:
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in kept.items():
                device = fn(buffer[:0]).device
                self._buffers[name] = buffer.to(device=device, dtype=torch.float32)
        return self

    fp32_buffers = ("expert_bias", "adaptive_aux_coeff", "qb_beta", "quantile_sum")
    """Buffers kept in fp32 whatever the module is cast to (subclasses add theirs)."""


def normalise_logits(logits_TE: torch.Tensor, scale: float) -> torch.Tensor:
    """Skywork-MoE's gating-logit normalisation (arXiv 2406.06563, section 3.1):
    z <- scale * (z - mean(z)) / std(z) over each token's experts, before the score function."""
    mean_T1 = logits_TE.mean(-1, keepdim=True)
    std_T1 = logits_TE.std(-1, keepdim=True).clamp_min(1e-6)
    return scale * (logits_TE - mean_T1) / std_T1


def _normal_init(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)
