"""Every entry of `megamoe.megatron.compat` against the installed megatron-core (CI runs this
file on 0.16.1 and on 0.19.x): each entry's claim about the version is checked on Megatron's
own code, not on megamoe's."""
import inspect
import re
import subprocess
import sys

import megatron.core as mcore
import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe import moe_utils

from megamoe.megatron import compat
from megamoe.megatron.runtime import setup_megatron, teardown_megatron


@pytest.fixture
def megatron():
    setup_megatron(seed=3)
    compat.reset_moe_tracker()
    yield
    compat.reset_moe_tracker()
    teardown_megatron()


def test_the_installed_version_is_read_and_not_older_than_the_oldest_supported():
    """CI's legs are the SUPPORTED versions; a newer release (Megatron-LM main ships 0.20)
    takes the newest entries' side of every difference."""
    # __version__ may carry a local part: megatron-core's package_info appends the commit of a
    # git repository its files lie in ("0.19.2+76b69ce" from a virtual environment inside a
    # checkout, as CI's)
    assert compat.version_string() == re.match(r"\d+\.\d+\.\d+", mcore.__version__).group()
    assert compat.MCORE_VERSION[:2] >= min(compat.SUPPORTED)


class Marker(torch.nn.Module):
    pass


def test_replace_submodules_on_the_local_specs_dense_mlp():
    mlp = get_gpt_layer_local_spec().submodules.mlp
    assert compat.SINCE_0_19 == (not hasattr(mlp, "submodules"))  # a builder from 0.19
    replaced = compat.replace_submodules(mlp, linear_fc1=Marker)
    submodules = (replaced.keywords["submodules"] if compat.SINCE_0_19
                  else replaced.submodules)
    original = mlp.keywords["submodules"] if compat.SINCE_0_19 else mlp.submodules
    assert submodules.linear_fc1 is Marker
    assert submodules.linear_fc2 is original.linear_fc2
    assert original.linear_fc1 is not Marker  # the shared spec is left alone


def test_tracker_entries_are_live_and_droppable(megatron):
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2.0), 1, 2)
    values = compat.tracker_entries()["load_balancing_loss"]
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(3.0), 2, 2)
    assert values.tolist() == [2.0, 3.0]  # the tensor Megatron keeps accumulating into
    compat.drop_tracker_entry("load_balancing_loss")
    assert "load_balancing_loss" not in moe_utils.get_moe_layer_wise_logging_tracker()
    moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(1.0), 1, 4)
    compat.reset_moe_tracker()
    assert moe_utils.get_moe_layer_wise_logging_tracker() == {}


class Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = float(value)


def _record_megamoe_layer():
    """What one megamoe layer (global layer 2 of 2) saves for one micro-batch."""
    from megamoe.megatron.tracker import report_load_metrics, save_layer_statistics

    report_load_metrics()
    selected_TE = torch.zeros(8, 4, dtype=torch.bool)
    selected_TE[:, 0] = True  # every token to expert 0: MaxVio 3
    save_layer_statistics({"aux_loss": torch.tensor(0.5)}, selected_TE, 2, 2)


def test_megamoe_load_metrics_reach_megatron_lms_logging(megatron):
    """Megatron-LM's training_log asks for its own aux-loss names only: core_v0.16 reports
    every entry anyway (`track_moe_metrics`); from 0.19 (and Megatron-LM main)
    `get_moe_metrics_tracker().report` reports only the names asked for, so megamoe's tracker
    adds its load metrics. Either way they reach the writer, per layer too."""
    _record_megamoe_layer()
    writer, totals = Writer(), {}
    asked = dict(loss_scale=1.0, iteration=1, writer=writer, total_loss_dict=totals,
                 per_layer_logging=True, force_initialize=True,
                 track_names=["load_balancing_loss"], num_layers=2, moe_layer_freq=[0, 1])
    if compat.SINCE_0_19:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().report(**asked)
    else:
        moe_utils.track_moe_metrics(**asked)
    assert writer.scalars["moe_maxvio_batch"] == pytest.approx(3.0)
    assert writer.scalars["moe/moe_maxvio_batch_layer_1"] == pytest.approx(3.0)
    assert writer.scalars["moe_experts_per_token"] == pytest.approx(1.0)
    assert float(totals["load_balancing_loss"]) == pytest.approx(0.5)
    assert compat.tracker_entries()["moe_maxvio_batch"].tolist() == [0.0, 0.0]  # zeroed


def test_reporting_tracker_keeps_what_was_recorded(megatron):
    if not compat.SINCE_0_19:
        pytest.skip("0.16's tracker is a dict that reports every entry: nothing to install")
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(1.5), 1, 1)
    compat.install_reporting_tracker(("moe_maxvio_batch",))
    assert get_moe_metrics_tracker().megamoe_extra_names == ("moe_maxvio_batch",)
    assert compat.tracker_entries()["z_loss"].tolist() == [1.5]


def test_dist_checkpointing_load_signature():
    from megatron.core import dist_checkpointing

    takes = "common_strategy" in inspect.signature(dist_checkpointing.load).parameters
    assert compat.load_takes_common_strategy() == takes == (not compat.SINCE_0_19)


def test_every_module_that_builds_the_dcp_reader_is_covered():
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    modules = compat.filesystem_reader_modules()
    assert torch_strategy in modules
    assert (serialization in modules) == compat.SINCE_0_19


def test_async_finalize_is_found_where_each_version_looks_it_up():
    from megatron.core.dist_checkpointing.strategies import state_dict_saver
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    modules = compat.async_finalize_modules()
    assert state_dict_saver in modules
    assert (torch_strategy in modules) == (not compat.SINCE_0_19)


@pytest.mark.slow
def test_te_general_gemm_mla_flag_and_legacy_grouped_mlp():
    """In a fresh import (the fallbacks change both once applied): `te_general_gemm` missing
    and MLA's HAVE_TE wrongly set on 0.16 without Transformer Engine, both right from 0.19;
    MLA's norm resolver exists from 0.19."""
    fresh = subprocess.run(
        [sys.executable, "-c", "from megamoe.megatron import compat; "
         "from megatron.core.transformer.moe import moe_utils; "
         "print(compat.te_general_gemm_missing(), hasattr(moe_utils, 'te_general_gemm'), "
         "compat.mla_claims_transformer_engine())"],
        capture_output=True, text=True, check=True)
    missing, present, mla_claims_te = fresh.stdout.split()
    assert missing != present
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        assert (missing == "True") == (not compat.SINCE_0_19)
        assert (mla_claims_te == "True") == (not compat.SINCE_0_19)
    assert (compat.mla_qk_norm_resolver() is not None) == compat.SINCE_0_19
    from megatron.core.transformer.moe import experts

    assert hasattr(experts, "GroupedMLP") == compat.HAS_LEGACY_GROUPED_MLP
    assert bool(compat.legacy_grouped_gemm_kwargs(True)) == compat.HAS_LEGACY_GROUPED_MLP


def test_mtp_layer_numbers_and_loss_record_are_as_the_entries_say(megatron):
    """Megatron's own GPT with one MTP depth (its own specs): depth 1's TransformerLayer is
    numbered 1 and marked `is_mtp_layer` from 0.19, num_layers + 1 before; the per-depth loss
    record is `loss_values` from 0.19, `values` before, and `take_mtp_losses` empties it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megamoe.megatron.cpu import cuda_as_cpu
    from megamoe.megatron.masks import causal_attention_mask
    from tiny_models import build_gpt, tiny_transformer_config

    config = tiny_transformer_config(num_layers=2, mtp_num_layers=1)
    spec = get_gpt_layer_local_spec()
    model = build_gpt(config, spec, 32, 8, mtp_block_spec=get_gpt_mtp_block_spec(
        config, spec, use_transformer_engine=False))
    (layer,) = [m for m in model.mtp.modules() if isinstance(m, TransformerLayer)]
    assert layer.layer_number == (1 if compat.SINCE_0_19 else 3)
    assert getattr(layer, "is_mtp_layer", False) == compat.SINCE_0_19
    assert compat.transformer_layer_number(layer) == 3
    assert compat.mtp_transformer_layer(model.mtp.layers[0]) is layer
    compat.reset_mtp_losses()
    tokens = torch.arange(16).reshape(2, 8)
    with cuda_as_cpu():
        model(tokens, torch.arange(8).expand(2, -1), causal_attention_mask(8), labels=tokens)
    record = MTPLossLoggingHelper.tracker["loss_values" if compat.SINCE_0_19 else "values"]
    assert record.shape == (1,) and float(record[0]) > 0
    taken = compat.take_mtp_losses()
    assert taken.shape == (1,) and float(taken[0]) > 0 and float(record[0]) == 0


def test_a_dataset_build_without_a_process_group_has_a_world_of_one():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with compat.process_group_for_dataset_build():
        assert dist.get_rank() == 0 and dist.get_world_size() == 1
    assert not dist.is_initialized()


@pytest.mark.slow
def test_importing_megamoe_silences_syntax_warnings_from_megatron_sources_only():
    """megatron-core 0.19.2 installed without byte-code warns while compiling its own sources;
    megamoe's CLIs must still print one-line errors, and a user's own warnings still show."""
    source = "x = 1 is 1  # a SyntaxWarning on every Python megamoe supports"
    check = ("import megamoe\n"
             f"compile({source!r}, '/site-packages/megatron/core/m.py', 'exec')\n"
             f"compile({source!r}, '/home/user/megatron_plugin.py', 'exec')\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          timeout=120, check=True)
    warned = [line for line in done.stderr.splitlines() if "SyntaxWarning" in line]
    assert len(warned) == 1 and "megatron_plugin.py" in warned[0], done.stderr
