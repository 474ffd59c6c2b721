"""The training config (every shipped recipe loads; overrides; validation) and the learning-rate
schedule against hand-computed values. In-process and fast: nothing here starts Megatron."""
from __future__ import annotations

from pathlib import Path

import pytest

import yaml

from megamoe.config import FLAT_NAMES
from megamoe.errors import ConfigError
from megamoe.train.config import (OptimizerConfig, apply_overrides, config_from_dict,
                                  dump_config, load_config)
from megamoe.train.schedule import LRSchedule

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads_and_round_trips(path):
    config = load_config(path)
    assert config_from_dict(yaml.safe_load(dump_config(config))) == config
    assert path.read_text().startswith("#")  # each recipe opens with its description
    assert "Hardware:" in path.read_text()


def _flat_form(moe: dict) -> dict:
    """The `moe` section of a shipped config written as configs were before the tree: every
    setting of a section under its old flat name (`router: {kind: topk}` -> `router_type`);
    settings newer than the tree, which never had a flat name (`router.bias`), stay nested."""
    old_name = {new: old for old, new in FLAT_NAMES.items()}
    flat = {key: value for key, value in moe.items() if not isinstance(value, dict)}
    for section, values in ((k, v) for k, v in moe.items() if isinstance(v, dict)):
        for name, value in values.items():
            if f"{section}.{name}" in old_name:
                flat[old_name[f"{section}.{name}"]] = value
            else:
                flat.setdefault(section, {})[name] = value
    return flat


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads_written_the_old_flat_way(path, tmp_path, capsys):
    """An older config (flat MoE keys) trains the same model: each flat key is read as its key
    in the tree, with one note line on stderr per key, printed once."""
    raw = yaml.safe_load(path.read_text())
    flat = _flat_form(raw["moe"])
    old = tmp_path / path.name
    old.write_text(yaml.safe_dump({**raw, "moe": flat}, sort_keys=False))
    assert load_config(old) == load_config(path)
    notes = capsys.readouterr().err.splitlines()
    moved = [key for key in flat if key in FLAT_NAMES]
    assert sorted(notes) == sorted(f"note: moe.{key} is now moe.{FLAT_NAMES[key]} (read as that)"
                                   for key in moved)
    assert moved or path.stem.startswith("simoe")  # the MoE recipes set routing settings


def test_recipes_say_what_they_claim():
    configs = {p.stem: load_config(p) for p in CONFIGS}
    assert set(configs) >= {"tiny_cpu", "mixtral_8x7b", "deepseek_v3", "upcycled_continue"}
    tiny = configs["tiny_cpu"]
    assert (tiny.model.num_layers, tiny.moe.num_experts, tiny.parallel.expert) == (4, 8, 2)
    ds = configs["deepseek_v3"].moe_config()
    assert (ds.num_experts, ds.topk, ds.router.num_groups, ds.router.groups_per_token) == \
        (256, 8, 8, 4)
    assert ds.balancing.uses_expert_bias
    assert ds.balancing.loss_coeffs == {"seq_aux_loss": 1e-4}
    assert ds.shared_expert.ffn_hidden_size and ds.router.score_function == "sigmoid"
    assert configs["deepseek_v3"].model.first_k_dense == 3
    assert configs["upcycled_continue"].checkpoint.init_from


def test_overrides_reach_nested_keys_and_parse_as_yaml():
    tiny = CONFIGS[[p.stem for p in CONFIGS].index("tiny_cpu")]
    config = load_config(tiny, ["optimizer.lr=1e-3", "moe.layer_overrides.2.num_experts=16",
                                "moe.router.score_function=softmax",
                                "data.prefixes=[a, b]", "data.tokenizer_model=t.model",
                                "checkpoint.init_from=null", "output_dir=elsewhere"])
    assert config.optimizer.lr == 1e-3 and isinstance(config.optimizer.lr, float)
    assert config.moe.layer_overrides == {2: {"num_experts": 16}}
    assert config.moe_config(2).num_experts == 16 and config.moe_config(1).num_experts == 8
    assert config.moe_config(2).router.score_function == "softmax"
    assert config.data.prefixes == ["a", "b"]
    assert config.output_dir == "elsewhere"


def test_tokenizer_model_is_read_as_tokenizer(tmp_path):
    """Configs written before data.tokenizer (data.tokenizer_model) train as they did; an
    override of either name replaces the file's tokenizer."""
    tiny = CONFIGS[[p.stem for p in CONFIGS].index("tiny_cpu")]
    config = load_config(tiny, ["data.prefixes=[a]", "data.tokenizer_model=t.model"])
    assert config.data.tokenizer == "t.model"
    old = tmp_path / "old.yaml"
    old.write_text(tiny.read_text() + "\ndata: {prefixes: [a], tokenizer_model: t.model}\n")
    assert load_config(old).data.tokenizer == "t.model"
    assert load_config(old, ["data.tokenizer=u.json"]).data.tokenizer == "u.json"
    assert load_config(old, ["data.tokenizer_model=v.model"]).data.tokenizer == "v.model"
    both = tmp_path / "both.yaml"
    both.write_text(tiny.read_text() + "\ndata: {prefixes: [a], tokenizer_model: t.model, "
                    "tokenizer: u.json}\n")
    with pytest.raises(ConfigError, match="data.tokenizer_model='t.model' and "
                       "data.tokenizer='u.json' in .* disagree"):
        load_config(both)


@pytest.mark.parametrize("raw, message", [
    ({"modle": {}}, "unknown config key 'modle' in the config; did you mean 'model"),
    ({"moe": {"num_experts": 8}}, "moe.ffn_hidden_size is missing"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8, "topk": 9}}, "topk=9 exceeds"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "training": {"train_steps": 0}},
     "training.train_steps=0 must be >= 1"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "data": {"prefixes": ["x"]}},
     "data.prefixes needs data.tokenizer"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8, "layer_overrides": {7: {"topk": 1}}}},
     "moe.layer_overrides names layer 7, outside 0..3"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "training": {"precision": "fp8"}},
     "training.precision='fp8' is not one of"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"hidden_size": 130}},
     "model.hidden_size=130 is not divisible by model.num_attention_heads=4"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "parallel": {"tensor": 3}},
     "model.num_attention_heads=4 is not divisible by parallel.tensor=3"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"num_query_groups": 2},
      "parallel": {"tensor": 4}}, "model.num_query_groups=2 is not divisible by parallel.tensor=4"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"ffn_hidden_size": 129,
      "first_k_dense": 1}, "parallel": {"tensor": 2}},
     "model.ffn_hidden_size=129 is not divisible by parallel.tensor=2"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"ffn_hidden_size": 129,
      "moe_layer_freq": 2}, "parallel": {"tensor": 2}},
     "model.ffn_hidden_size=129 is not divisible by parallel.tensor=2"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"seq_length": 127},
      "parallel": {"tensor": 2}}, "model.seq_length=127 is not divisible by parallel.tensor=2"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "data": {"split": "inf,1,0"}},
     "data.split='inf,1,0' must be one to three comma-separated non-negative decimal"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "data": {"split": "9" * 400 + ",1"}},
     "(404 characters) must give the splits a finite, non-zero total weight"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "data": {"split": "0,5,0"}},
     "data.split='0,5,0' gives the train split no weight"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8},
      "data": {"prefixes": ["a", "b"], "tokenizer_model": "t", "weights": [0, 1]}},
     "data.weights=[0.0, 1.0] must be 2 positive weight(s) of finite sum"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8},
      "data": {"prefixes": ["a", "b"], "tokenizer_model": "t", "weights": [1e308, 1e308]}},
     "data.weights=[1e+308, 1e+308] must be 2 positive weight(s) of finite sum"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"moe_layer_freq": 0}},
     "model.moe_layer_freq=0 must be >= 1"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"moe_layer_freq": [1, 0]}},
     "model.moe_layer_freq=[1, 0] must be a 0/1 list of length num_layers=4"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"first_k_dense": 7}},
     "model.first_k_dense=7 must be in 0..num_layers=4"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "parallel": {"first_stage_layers": 16}},
     "parallel.first_stage_layers=16 leave -12 of model.num_layers=4 for 0 middle stage(s)"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8},
      "parallel": {"pipeline": 3, "first_stage_layers": 1}},
     "parallel.first_stage_layers=1 leave 3 of model.num_layers=4 for 2 middle stage(s)"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"num_layers": 5},
      "parallel": {"pipeline": 2, "virtual_stages": 2, "first_stage_layers": 3}},
     "every stage's layers ([3, 2]) must split evenly over the virtual stages"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "training": {"micro_batch_size": True}},
     "training.micro_batch_size=True is not a valid int"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "finetune": {"method": "qlora"}},
     "finetune.method='qlora' is not one of"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "finetune": {"method": "simoe"}},
     "finetune.method=simoe adapts a dense model: set model.first_k_dense=4"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"first_k_dense": 4},
      "finetune": {"method": "simoe", "simoe": {"experts": 4}}},
     "finetune.simoe has unknown keys ['experts']"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"first_k_dense": 4},
      "finetune": {"method": "simoe", "simoe": {"target_sparsity": 1.5}}},
     "simoe.target_sparsity=1.5 must be in [0, 1)"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "model": {"first_k_dense": 4},
      "parallel": {"tensor": 2}, "finetune": {"method": "lora"}},
     "finetune.method=lora trains at parallel.tensor=1"),
    ({"moe": {"num_experts": 8, "ffn_hidden_size": 8}, "parallel": {"pipeline": 2},
      "finetune": {"method": "full"}},
     "finetune.method=full runs with parallel.pipeline=1"),
] + [({"moe": {"num_experts": 8, "ffn_hidden_size": 8},
         "model": {"multi_latent_attention": True, "position_embedding": "rope", **model},
         **sections}, message) for model, sections, message in [
    ({"position_embedding": "learned_absolute"}, {},
     "model.position_embedding='learned_absolute' cannot be combined with "
     "model.multi_latent_attention"),
    ({"num_query_groups": 2}, {}, "model.num_query_groups=2 cannot be combined with"),
    ({"rope_scaling_factor": 8.0}, {}, "use model.yarn for MLA"),
    ({"kv_channels": 16}, {}, "set model.qk_head_dim and model.v_head_dim"),
    ({"q_lora_rank": 0}, {}, "model.q_lora_rank=0 must be >= 1 or null"),
    ({"qk_pos_emb_head_dim": 3}, {}, "model.qk_pos_emb_head_dim=3 must be even"),
    ({"q_lora_rank": 7}, {"parallel": {"tensor": 2}},
     "model.q_lora_rank=7 is not divisible by parallel.tensor=2"),
    ({"yarn": {"factr": 4}}, {}, "model.yarn has unknown key 'factr'; did you mean 'factor'?"),
    ({"yarn": {"beta_fast": 8}}, {}, "model.yarn needs a factor"),
    ({"yarn": {"factor": 0.5}}, {}, "model.yarn.factor=0.5 must be >= 1"),
    ({"yarn": {"factor": 4, "truncate": False}}, {},
     "model.yarn.truncate=false cannot be combined with model.multi_latent_attention"),
    ({"attention_sinks": True}, {},
     "model.attention_sinks=True cannot be combined with model.multi_latent_attention"),
    ({"multi_latent_attention": False, "yarn": {"factor": 4}, "rope_scaling_factor": 8.0}, {},
     "model.rope_scaling_factor=8.0 (Llama 3's scaling) cannot be combined with model.yarn"),
    ({"multi_latent_attention": False, "yarn": {"factor": 4, "truncate": "no"}}, {},
     "model.yarn.truncate='no' must be true or false"),
    ({"multi_latent_attention": False, "sliding_window": 0}, {},
     "model.sliding_window=0 must be a whole number >= 1 or null"),
    ({"multi_latent_attention": False, "sliding_window": 8, "sliding_window_layers": [1, 2]},
     {}, "model.sliding_window_layers=[1, 2] must list 0 or 1 for each of the "
     "model.num_layers=4 layers"),
    ({"multi_latent_attention": False, "sliding_window_layers": [1, 0, 1, 0]}, {},
     "needs model.sliding_window"),
    ({"multi_latent_attention": False},
     {"training": {"recompute": "selective", "recompute_modules": ["mla_up_proj"]}},
     "'mla_up_proj', which needs model.multi_latent_attention=true"),
]])
def test_invalid_configs_name_the_value(raw, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_tensor_ranks_need_not_divide_an_unused_dense_mlp():
    """With every layer MoE there is no dense MLP to split, so its width does not constrain
    the tensor size (megamoe's experts are not tensor-parallel)."""
    config = config_from_dict({"moe": {"num_experts": 8, "ffn_hidden_size": 8},
                               "model": {"ffn_hidden_size": 129}, "parallel": {"tensor": 2}})
    assert config.parallel.tensor == 2


def test_yarn_overrides_reach_its_keys():
    raw = {"moe": {"num_experts": 8, "ffn_hidden_size": 8},
           "model": {"multi_latent_attention": True, "position_embedding": "rope"}}
    config = config_from_dict(apply_overrides(raw, ["model.yarn.factor=40",
                                                    "model.yarn.mscale_all_dim=1"]))
    assert config.model.yarn == {"factor": 40, "mscale_all_dim": 1}
    grouped = config_from_dict(apply_overrides(  # GPT-OSS's, for grouped-query attention
        {**raw, "model": {"position_embedding": "rope"}},
        ["model.yarn.factor=32", "model.yarn.truncate=false"]))
    assert grouped.model.yarn == {"factor": 32, "truncate": False}


def test_simoe_overrides_reach_its_fields_and_a_typo_is_named():
    seed = CONFIGS[[p.stem for p in CONFIGS].index("simoe_instruct")]
    config = load_config(seed, ["finetune.simoe.orthogonality_coefficient=0.5",
                                "finetune.simoe.router_temperature=[2, 1]"])
    assert config.finetune.simoe == {"num_experts": 8, "target_sparsity": 0.75,
                                     "orthogonality_coefficient": 0.5,
                                     "router_temperature": [2, 1]}
    with pytest.raises(ConfigError, match=r"finetune.simoe has unknown keys \['target'\]"):
        load_config(seed, ["finetune.simoe.target=0.5"])
    with pytest.raises(ConfigError, match=r"finetune.simoe.target_sparsity='abc' is not a valid "
                                          r"float"):
        load_config(seed, ["finetune.simoe.target_sparsity=abc"])
    with pytest.raises(ConfigError, match=r"finetune.simoe.router_temperature\[1\]='x' is not"):
        load_config(seed, ["finetune.simoe.router_temperature=[2, x]"])


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [1,\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML at line \d"):
        load_config(bad)


def _schedule(style: str) -> LRSchedule:
    return LRSchedule.from_config(OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10,
                                                  decay_steps=20, decay_style=style), 100)


@pytest.mark.parametrize("style, expected", [
    # steps:   1     5     10    20     25      30    60
    ("cosine", [0.1, 0.5, 1.0, 0.55, 0.1 + 0.9 * 0.5 * (1 - 2 ** -0.5), 0.1, 0.1]),
    ("linear", [0.1, 0.5, 1.0, 0.55, 0.325, 0.1, 0.1]),
    ("constant", [0.1, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
])
def test_lr_schedule_warms_up_then_decays(style, expected):
    schedule = _schedule(style)
    got = [schedule(step) for step in (1, 5, 10, 20, 25, 30, 60)]
    assert got == pytest.approx(expected, abs=1e-12)
