"""`pretrain_gpt.py --spec megamoe.megatron.specs NAME`, consumed exactly as Megatron-LM does.

Reproduced here from Megatron-LM's sources (not imported: Megatron-LM is not a package):
- core_v0.16.x-0.18.x `gpt_builders.gpt_builder`: `transformer_layer_spec = import_module(args.spec)`
  and `GPTModel(config=config, transformer_layer_spec=transformer_layer_spec, ...)`, no call.
- core_v0.19+ `megatron/training/models/gpt.py` `GPTModelBuilder.build_model`: the spec object
  is stored on a GPTModelConfig (which forwards attribute reads to its `transformer`
  TransformerConfig); if it is callable and not a ModuleSpec it is called as
  `spec(model_config, vp_stage=vp_stage)` (or `spec(model_config)` without a vp_stage
  parameter); GPTModel then gets `config=model_config.transformer`.
"""
import inspect
import math
import os

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megamoe.errors import ConfigError
from megamoe.megatron.masks import causal_attention_mask
from tiny_models import tiny_transformer_config
from megamoe.megatron.moe_module import MegatronMoELayer
from megamoe.megatron.runtime import setup_megatron, teardown_megatron

VOCAB, SEQ = 64, 8
NAMES = ["layer_spec", "decoder_block_spec"]


@pytest.fixture(scope="module")
def megatron():
    setup_megatron(seed=3)
    yield
    teardown_megatron()


class GPTModelConfigLike:
    """Megatron-LM's GPTModelConfig as the spec function sees it: not a TransformerConfig,
    attribute reads forwarded to `transformer`."""

    def __init__(self, transformer, vocab_size):
        self.transformer = transformer
        self.vocab_size = vocab_size

    def __getattr__(self, name):
        transformer = object.__getattribute__(self, "transformer")
        if hasattr(transformer, name):
            return getattr(transformer, name)
        raise AttributeError(name)


def build_like_core_v0_16(spec_name, config):
    spec = import_module(("megamoe.megatron.specs", spec_name))
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=False)


def build_like_core_v0_19(spec_name, config, vp_stage=None):
    model_config = GPTModelConfigLike(config, VOCAB)
    spec = import_module(("megamoe.megatron.specs", spec_name))
    if not isinstance(spec, ModuleSpec) and callable(spec):
        if "vp_stage" in inspect.signature(spec).parameters:
            spec = spec(model_config, vp_stage=vp_stage)
        else:
            spec = spec(model_config)
    return GPTModel(config=model_config.transformer, transformer_layer_spec=spec,
                    vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=True,
                    post_process=True, share_embeddings_and_output_weights=False, vp_stage=vp_stage)


def moe_config(**changes):
    base = dict(num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
    return tiny_transformer_config(**{**base, **changes})


def layer_kinds(model):
    return [isinstance(layer.mlp, MegatronMoELayer) for layer in model.decoder.layers]


PATTERNS = [(1, [True] * 4), (2, [True, False, True, False]), ([0, 1, 1, 0], [False, True, True, False]),
            ([0, 0, 0, 1], [False, False, False, True])]


@pytest.mark.parametrize("freq, expected", PATTERNS)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("build", [build_like_core_v0_16, build_like_core_v0_19])
def test_spec_names_honour_moe_layer_freq(megatron, build, name, freq, expected):
    config = moe_config(moe_layer_freq=freq)
    model = build(name, config)
    assert layer_kinds(model) == expected
    numbers = [layer.mlp.router.layer_number for layer in model.decoder.layers
               if isinstance(layer.mlp, MegatronMoELayer)]
    assert numbers == [i + 1 for i, moe in enumerate(expected) if moe]
    dense = [layer.mlp for layer in model.decoder.layers if not isinstance(layer.mlp, MegatronMoELayer)]
    assert all(m.linear_fc1.weight.shape[0] == config.ffn_hidden_size for m in dense)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    positions = torch.arange(SEQ).expand(2, -1)
    loss = model(tokens, positions, causal_attention_mask(SEQ), labels=tokens).mean()
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", NAMES)
def test_spec_objects_are_what_both_megatron_paths_accept(name):
    """Both versions accept a ModuleSpec of a transformer layer; the 0.19+ builder uses a
    ModuleSpec as is. Called as a spec function the objects still return usable specs."""
    from megamoe.megatron import specs

    spec = getattr(specs, name)
    assert isinstance(spec, ModuleSpec)
    config = GPTModelConfigLike(moe_config(moe_layer_freq=[0, 1, 0, 1]), VOCAB)
    resolved = spec(config, vp_stage=None)
    if name == "decoder_block_spec":
        assert isinstance(resolved, TransformerBlockSubmodules)
        kinds = [layer.submodules.mlp.module is MegatronMoELayer
                 if isinstance(layer.submodules.mlp, ModuleSpec) else False
                 for layer in resolved.layer_specs]
        assert kinds == [False, True, False, True]
    else:
        assert resolved is spec


def test_called_block_spec_builds_the_same_model(megatron):
    """decoder_block_spec(GPTModelConfig-like, vp_stage) into GPTModel equals the bare object."""
    config = moe_config(moe_layer_freq=[1, 0, 1, 1])
    from megamoe.megatron.specs import decoder_block_spec

    torch.manual_seed(0)
    called = GPTModel(config=config, transformer_layer_spec=decoder_block_spec(
        GPTModelConfigLike(config, VOCAB), vp_stage=None), vocab_size=VOCAB,
        max_sequence_length=SEQ, share_embeddings_and_output_weights=False)
    torch.manual_seed(0)
    bare = build_like_core_v0_16("decoder_block_spec", config)
    assert layer_kinds(called) == layer_kinds(bare) == [True, False, True, True]
    assert set(called.state_dict()) == set(bare.state_dict())


def test_bad_moe_layer_freq_is_one_clear_error(megatron):
    with pytest.raises(ConfigError, match="moe_layer_freq=.* must be a 0/1 list of length"):
        build_like_core_v0_16("layer_spec", moe_config(moe_layer_freq=[1, 0, 1, 1, 1][:4] + [1]))


def test_transformer_engine_is_used_when_it_imports():
    from megamoe.megatron import specs

    config = moe_config()
    if not specs.transformer_engine_available():
        assert not specs._uses_transformer_engine(config, None)
        pytest.skip("Transformer Engine does not import here (needs CUDA)")
    from megatron.core.extensions.transformer_engine import TENorm

    assert specs._uses_transformer_engine(config, None)
    assert specs.layer_spec.submodules.pre_mlp_layernorm is TENorm


PRETRAIN_GPT_WITH_MLA = """
import os, sys
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import MLATransformerConfig
from megatron.core.transformer.spec_utils import import_module
from megamoe.megatron.cpu import enable_megatron_on_cpu  # CPU for CUDA, not the fallbacks

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
enable_megatron_on_cpu()
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)  # as Megatron-LM's initialize does
config = MLATransformerConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, num_moe_experts=2,
    moe_ffn_hidden_size=16, moe_router_topk=2, moe_layer_freq=[0, 1], q_lora_rank=16,
    kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="rope",
    use_cpu_initialization=True, transformer_impl="local", normalization="RMSNorm",
    add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
spec = import_module(("megamoe.megatron.specs", sys.argv[1]))
model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8,
                 position_embedding_type="rope", share_embeddings_and_output_weights=False)
tokens = torch.randint(0, 64, (2, 8))
mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1)
loss = model(tokens, torch.arange(8).expand(2, -1), mask, labels=tokens).mean()
print("attention", type(model.decoder.layers[0].self_attention).__name__, "loss", float(loss))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_spec_builds_latent_attention_without_a_manual_fallback_call(name):
    """Megatron-LM's `pretrain_gpt.py` on megatron-core 0.16.1 without Transformer Engine imports
    the spec and builds GPTModel with multi-latent attention, and calls nothing of megamoe's:
    in a fresh process (no `enable_local_fallbacks()` or `setup_megatron`) the model builds and
    its loss is finite."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", PRETRAIN_GPT_WITH_MLA, name, str(port)],
                          cwd=repo, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    assert words[words.index("attention") + 1] == "MLASelfAttention"
    assert math.isfinite(float(words[words.index("loss") + 1]))
