"""SIMoEConfig: the knobs of Sparse Interpolated Mixture-of-Experts, validated in one place.

Where the SIMoE paper (Chen, Wei, Schwarz, ACL 2025, arXiv 2506.12597) does not state a detail,
the default follows its predecessor SMAT (Chen et al., ICML 2024), as `../shared/research-notes.md`
records; each such field says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.errors import ConfigError


@dataclass
class SIMoEConfig:
    num_experts: int = 8
    """M: structured masks over the one shared delta (SIMoE uses 8)."""

    target_sparsity: float = 0.75
    """Fraction of the delta each expert should mask out (SIMoE: 75%); 0 keeps every column."""

    log_alpha_init_std: float = 0.5
    """Hard-concrete gates start at log-alpha ~ N(0, std) (SMAT's init; not confirmed for SIMoE)."""

    gate_noise: float = 1.0e-6
    """Training draws each gate's uniform noise from U(0.5 - gate_noise, 0.5 + gate_noise) (SMAT:
    1e-6, nearly deterministic); the gates served are those at u = 0.5, so with SMAT's value the
    model served is the model trained. 0.5 is Louizos et al.'s full U(0, 1) sampling."""

    straight_through: bool = True
    """The gates' clamp to [0, 1] passes the loss's gradient straight through (Bengio et al.,
    arXiv 1308.3432), values unchanged. With nearly deterministic gates a gate pushed below 0
    otherwise never hears the loss again, and the one-sided Lagrangian overshoots for good (a toy
    regression that wants every column: served density 0.07-0.12 for a target of 0.25). SMAT has
    no such estimator (its sampled masks get no gradient at 0 either); false is its behaviour."""

    log_alpha_clip: float = 4.6
    """Log-alpha is clipped to +-this (SMAT: log 100); beyond it a gate is 0 or 1 and the
    penalties stop pushing it, so a closed column stays within reach of the loss."""

    mask_lr_scale: float = 50.0
    """The masks learn this many times faster than the delta (SMAT, like CoFi, gives the mask
    parameters their own larger learning rate; here one schedule serves both: the gates' log-alpha
    is stored divided by this factor, and Adam's step is invariant to that scale)."""

    lagrangian_lr: float = 0.1
    """Step size of the dual ascent on each expert's sparsity multiplier (SMAT's one-sided
    Lagrangian; the step size is not published, ours is sized for a loss of order 1)."""

    orthogonality_coefficient: float = 1.0
    """Weight of the orthogonality penalty, the mean pairwise cosine similarity of the experts'
    masks (SIMoE's "where to upcycle" term), at the scale of the sparsity Lagrangian's
    multipliers (at 1e-2 on the raw overlap it was weaker than the pull of the experts' shared
    gradients: the masks overlapped more than independent ones)."""

    router_input: str = "hidden"
    """What the prompt router pools: `hidden`, the seed model's final hidden states of the prompt
    (SMAT reads its backbone's features), or `embeddings`, the prompt's input embeddings."""

    router_temperature: tuple[float, float] = (5.0, 0.5)
    """(start, end) temperature of the router's per-expert scores, annealed linearly (SMAT: 5 to
    0.5, the scores sigmoid(logit / T) normalised to sum 1, relaxed-Bernoulli samples in training)."""

    router_anneal_steps: int = 0
    """Optimizer steps of the annealing; 0 anneals over the run's `training.train_steps` (SMAT
    anneals over 18,000 updates, most of its run)."""

    router_lr_scale: float = 1.0
    """The router's learning rate relative to the delta's (SMAT trains it with its own optimizer);
    applied like `mask_lr_scale`, through the stored scale of its weights."""

    router_logit_penalty: float = 1.0e-4
    """Coefficient of the router-logit penalty added to the training loss: this times the mean
    over the batch's sequences and the experts of the squared router logits k_m . f_b (before
    the temperature and the relaxed-Bernoulli noise). SMAT (Chen et al., ICML 2024; its public
    code adds 1e-4 x the mean squared selection logit, "for stabilised training") uses it to keep
    the sigmoid scores from saturating, where an expert at score 0 (or 1) for every prompt no
    longer hears the loss; 0 turns it off."""

    selection_weighted_sparsity: bool = True
    """Weight each expert's term of the sparsity Lagrangian, multiplier_m (density_m - target),
    by that expert's merging coefficient for the batch (a_bm averaged over its sequences, so the
    weights sum to 1), detached from the router: SMAT (ICML 2024) weights each mask's Lagrangian
    and expected-L0 terms by the task's selection scores taken from its logs (no gradient to the
    selector), so the experts the router picks carry their sparsity pressure and the sparsity
    term never pushes the router away from an expert. False: every expert weighs 1 (the
    Lagrangian's dual step on the multipliers is unweighted either way)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"simoe.num_experts={self.num_experts} must be at least 1")
        if not 0.0 <= self.target_sparsity < 1.0:
            raise ConfigError(f"simoe.target_sparsity={self.target_sparsity} must be in [0, 1), "
                              "the fraction of each expert's delta that is masked out")
        for name in ("mask_lr_scale", "router_lr_scale", "log_alpha_clip"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"simoe.{name}={getattr(self, name)} must be > 0")
        for name in ("log_alpha_init_std", "lagrangian_lr", "orthogonality_coefficient",
                     "router_anneal_steps", "router_logit_penalty"):
            if getattr(self, name) < 0:
                raise ConfigError(f"simoe.{name}={getattr(self, name)} must be >= 0")
        if not 0.0 <= self.gate_noise <= 0.5:
            raise ConfigError(f"simoe.gate_noise={self.gate_noise} must be in [0, 0.5] (SMAT: "
                              "1e-6; 0.5 samples the full U(0, 1))")
        if self.router_input not in ("hidden", "embeddings"):
            raise ConfigError(f"simoe.router_input={self.router_input!r}: choose 'hidden' or "
                              "'embeddings'")
        temperatures = self.router_temperature
        if not isinstance(temperatures, (list, tuple)) or len(temperatures) != 2 \
                or not all(isinstance(t, (int, float)) and t > 0 for t in temperatures):
            raise ConfigError(f"simoe.router_temperature={list(self.router_temperature)} must be "
                              "[start, end], both > 0 (SMAT: [5.0, 0.5])")
        self.router_temperature = (float(temperatures[0]), float(temperatures[1]))
