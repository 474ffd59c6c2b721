"""Muon (megamoe.optim): each expert's matrices orthogonalised on their own, against a naive
per-matrix Newton-Schulz written here in float64; the quintic's singular-value band; Moonlight's
update scaling; which parameters AdamW keeps; and the one-line refusals."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from megamoe.config import MoEConfig
from megamoe.errors import ConfigError
from megamoe.layer import MoELayer
from megamoe.optim.muon import Matrix, Muon
from megamoe.optim.newton_schulz import newton_schulz
from megamoe.optim.params import classify, split_parameters

A, B, C = 3.4445, -4.7750, 2.0315
REPO = Path(__file__).resolve().parents[2]


def naive_orthogonal(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al.'s quintic iteration on one matrix, in float64, as written in the post."""
    x = m.double()
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.t()
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.t()
        x = A * x + B * gram @ x + C * gram @ gram @ x
    return x.t() if transpose else x


def moe(**experts) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(MoEConfig.from_dict({"hidden_size": 16, "num_experts": 3,
                                         "ffn_hidden_size": 8, "topk": 2,
                                         "experts": experts,
                                         "shared_expert": {"ffn_hidden_size": 12, "gate": True}}))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_stacked_expert_update_is_per_expert_naive_newton_schulz(activation):
    layer = moe(activation=activation)
    lr, wd, mu = 0.02, 0.1, 0.95
    muon, _ = split_parameters(layer)
    params = [p for p, _ in muon]
    opt = Muon([{"params": params, "matrices": [m for _, m in muon]}], lr=lr, momentum=mu,
               weight_decay=wd)
    for weight in (layer.experts.fc1_weight, layer.experts.fc2_weight):
        start = weight.detach().double().clone()
        grads = [torch.randn_like(weight) for _ in range(2)]
        buffer = torch.zeros_like(start)
        for grad in grads:
            for p in params:
                p.grad = grad if p is weight else None
            opt.step()
            buffer = mu * buffer + grad.double()
            nesterov = grad.double() + mu * buffer
            expected = []
            for expert in nesterov:  # one expert at a time; a GLU fc1's halves separately
                halves = expert.chunk(2) if (weight is layer.experts.fc1_weight
                                             and activation == "swiglu") else (expert,)
                expected.append(torch.cat([naive_orthogonal(h) * 0.2 * math.sqrt(max(h.shape))
                                           for h in halves]))
            start = start * (1 - lr * wd) - lr * torch.stack(expected)
        torch.testing.assert_close(weight.detach().double(), start, rtol=0, atol=2e-6)


def test_stacked_differs_from_one_matrix():
    """The per-expert update is not the update of the experts' rows as one matrix."""
    m = torch.randn(3, 8, 16)
    per_expert = newton_schulz(m)
    whole = newton_schulz(m.reshape(24, 16)).reshape(3, 8, 16)
    assert (per_expert - whole).abs().max() > 0.1


def test_singular_values_in_the_quintic_band():
    """Five steps of Jordan's quintic take every singular value of a matrix into roughly
    [0.7, 1.2] (the iteration's attracting band, not 1 exactly) unless it started tiny (below
    1% of the Frobenius norm: p'(0) = 3.4445 per step does not lift it that far), and keep U
    and V: the result is close to the exact orthogonal factor U Vᵀ."""
    torch.manual_seed(1)
    for shape in [(64, 32), (32, 96), (48, 48)]:
        g = torch.randn(shape, dtype=torch.float64)
        o = newton_schulz(g).double()
        u, s_in, vh = torch.linalg.svd(g, full_matrices=False)
        s_out = (u.t() @ o @ vh.t()).diagonal()  # o's singular values, in g's singular vectors
        torch.testing.assert_close(u @ torch.diag(s_out) @ vh, o, rtol=0, atol=1e-5)
        kept = s_out[s_in / g.norm() > 0.01]
        assert kept.min() > 0.65 and kept.max() < 1.25, (shape, kept.min(), kept.max())
        if shape[0] != shape[1]:  # a square Gaussian matrix has a few tiny singular values
            assert len(kept) == min(shape)


def test_moonlight_scaling_gives_adamw_update_rms():
    """Moonlight: 0.2 sqrt(max(A, B)) U Vᵀ has RMS 0.2 (AdamW's typical update RMS), whatever
    the shape; Jordan's scaling does not."""
    torch.manual_seed(2)
    for rows, cols in [(64, 16), (16, 64), (32, 32)]:
        p = nn.Parameter(torch.zeros(rows, cols))
        opt = Muon([{"params": [p], "matrices": [Matrix()]}], lr=1.0, weight_decay=0.0,
                   momentum=0.0, nesterov=False)
        p.grad = torch.randn(rows, cols)
        opt.step()
        rms = float(p.detach().pow(2).mean().sqrt())
        assert 0.2 * 0.8 < rms < 0.2 * 1.1, (rows, cols, rms)


def test_adamw_keeps_the_stated_kinds():
    layer = moe(activation="swiglu")
    model = nn.ModuleDict({"embed": nn.Embedding(10, 16), "norm": nn.LayerNorm(16),
                           "moe": layer, "proj": nn.Linear(16, 16), "head": nn.Linear(16, 10)})
    model["head"].weight.is_embedding_or_output_parameter = True
    kinds = {name: t.kind for name, _, t in classify(model)}
    assert kinds == {
        "embed.weight": "embedding or output layer", "head.weight": "embedding or output layer",
        "norm.weight": "norm or bias", "norm.bias": "norm or bias", "proj.bias": "norm or bias",
        "head.bias": "norm or bias", "proj.weight": "linear weight",
        "moe.router.weight": "router",
        "moe.experts.fc1_weight": "stacked expert weight",
        "moe.experts.fc2_weight": "stacked expert weight",
        "moe.shared_experts.linear_fc1.weight": "linear weight",
        "moe.shared_experts.linear_fc2.weight": "linear weight",
        "moe.shared_experts.gate_weight": "shared-expert gate"}, kinds
    matrices = {name: t.matrix for name, _, t in classify(model) if t.matrix is not None}
    assert matrices["moe.shared_experts.linear_fc1.weight"].glu_halves
    assert matrices["moe.experts.fc1_weight"] == Matrix(stacked=True, glu_halves=True)
    assert not matrices["moe.experts.fc2_weight"].glu_halves


def test_untreatable_parameter_is_one_line_error():
    model = nn.Module()
    model.kernel = nn.Parameter(torch.zeros(2, 3, 4))
    with pytest.raises(ConfigError, match=r"parameter kernel of shape \[2, 3, 4\].*adamw") as e:
        classify(model)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"ns_steps": 0}, "ns_steps=0"),
    ({"ns_steps": 10**9}, "ns_steps=1000000000 must be an integer from 1 to 100"),
    ({"ns_coefficients": (3.4445, float("nan"), 2.0315)}, "ns_coefficients"),
    ({"ns_coefficients": (3.4445, float("inf"), 2.0315)}, "ns_coefficients"),
    ({"scale": "spectral"}, "scale='spectral'"),
])
def test_bad_settings_are_one_line_errors(kwargs, match):
    p = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ConfigError, match=match) as e:
        Muon([{"params": [p], "matrices": [Matrix()]}], **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("optimizer, match", [
    ({"name": "mun"}, r"optimizer.name='mun' is not one of \['adamw', 'muon'\]; did you mean "
                      r"'muon'\?"),
    ({"name": "muon", "muon": {"ns_steps": 0}}, r"optimizer.muon.ns_steps=0 must be"),
    ({"name": "muon", "muon": {"ns_steps": 1e9}}, r"optimizer.muon.ns_steps"),
    ({"name": "muon", "muon": {"ns_coefficients": [3.4445, float("nan"), 2.0315]}},
     r"optimizer.muon.ns_coefficients\[1\]"),
    ({"name": "muon", "muon": {"nsteps": 3}}, r"did you mean 'optimizer.muon.ns_steps'"),
])
def test_trainer_optimizer_settings_refused_in_one_line(optimizer, match):
    import yaml

    from megamoe.train.config import config_from_dict

    raw = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    raw["optimizer"].update(optimizer)
    with pytest.raises(ConfigError, match=match) as e:
        config_from_dict(raw)
    assert "\n" not in str(e.value)


def test_resume_refuses_another_optimizer():
    """A checkpoint of an AdamW run (or of a run from before optimizer.name: AdamW) is not
    resumed with Muon: one line naming optimizer.name and checkpoint.init_from."""
    from megamoe.errors import CheckpointError
    from megamoe.train.settings.optimizer import check_resumed_optimizer

    check_resumed_optimizer({"optimizer": {"name": "muon"}}, "muon", "ckpt")
    check_resumed_optimizer({"optimizer": {"lr": 1e-3}}, "adamw", "ckpt")
    for saved in ({"optimizer": {"name": "adamw"}}, {"optimizer": {"lr": 1e-3}}):
        with pytest.raises(CheckpointError, match=r"optimizer.name=adamw, this run sets "
                           r"optimizer.name=muon.*checkpoint.init_from=ckpt") as e:
            check_resumed_optimizer(saved, "muon", "ckpt")
        assert "\n" not in str(e.value)


def test_megatron_gpt_kinds():
    """In a Megatron-Core GPTModel with megamoe MoE layers: word and position embeddings and
    the output layer, norms, routers and gates go to AdamW; attention, dense MLPs, shared
    experts (GLU halves split) and the stacked experts to Muon."""
    from megamoe.megatron.fields import moe_config_from_transformer_config
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.megatron.specs import gpt_decoder_block_spec
    from tiny_models import build_gpt, tiny_transformer_config

    setup_megatron(seed=3)
    try:
        config = tiny_transformer_config(num_layers=2, num_moe_experts=4, moe_router_topk=2,
                                         moe_ffn_hidden_size=32, moe_layer_freq=[0, 1],
                                         gated_linear_unit=True,
                                         activation_func=torch.nn.functional.silu)
        moe = moe_config_from_transformer_config(
            config, {"shared_expert": {"ffn_hidden_size": 32, "gate": True}})
        model = build_gpt(config, gpt_decoder_block_spec(config, moe), vocab_size=64,
                          seq_len=8)
        kinds = {}
        for name, _, treatment in classify(model):
            kinds.setdefault(treatment.kind, set()).add(
                re.sub(r"^(decoder\.layers\.\d+\.|embedding\.)", "", name))
    finally:
        teardown_megatron()
    assert kinds["embedding or output layer"] == {
        "word_embeddings.weight", "position_embeddings.weight", "output_layer.weight"}
    assert kinds["router"] == {"mlp.router.weight"}
    assert kinds["shared-expert gate"] == {"mlp.shared_experts.gate_weight"}
    assert kinds["stacked expert weight"] == {"mlp.experts.fc1_weight", "mlp.experts.fc2_weight"}
    assert {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
            "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_experts.linear_fc2.weight"} == kinds["linear weight"]
    assert all("norm" in name for name in kinds["norm or bias"]), kinds["norm or bias"]
    glu = {name for name, _, t in classify(model) if t.matrix is not None and t.matrix.glu_halves}
    assert {re.sub(r"^decoder\.layers\.\d+\.", "", name) for name in glu} == {
        "mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight", "mlp.experts.fc1_weight"}
