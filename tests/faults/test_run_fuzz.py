"""Fuzzed configs, overrides and command lines (hypothesis): every input either gives a config
that Megatron-Core accepts or one `error: ...` line with exit code 2, never a traceback.

In-process: `load_config` on the tiny config with random overrides and on random YAML files,
then Megatron's TransformerConfig of the result (as a run builds it first); the entry point
`megamoe.train.__main__.main` on random command lines, with the training itself stubbed out. A
few failing examples also go through the real CLI as subprocesses. CI=true runs fewer examples.
"""
from __future__ import annotations

import sys

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from run_harness import QUICK, REPO, TINY, env

from megamoe.errors import MegaMoEError
from megamoe.train import loop
from megamoe.train.__main__ import main
from megamoe.train.config import known_keys, load_config
from megamoe.train.model import transformer_config
import warm_launcher

EXAMPLES = 30 if QUICK else 200
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
KEYS = known_keys()

YAML_VALUES = ["true", "false", "null", "~", "[]", "{}", "[1, 2]", "{a: 1}", ".nan", ".inf",
               "-.inf", "1e400", "0", "-1", "''", "[a, b]", "3e-4", "{0: {topk: 1}}", ":", "- x",
               "!!python/object/apply:os.system [echo]", "&a [*a]", "[[]]", "0x10", "1_000",
               "2020-01-01", "'8'", "8.0", "-0.0", "{num_experts: 0}", "@", "\t"]


def _mutated(key: str, draw) -> str:
    """`key` with a typo: a character dropped or swapped, upper case, a suffix, another section."""
    kind = draw(st.sampled_from(["drop", "swap", "case", "extra", "section"]))
    if kind == "drop" and len(key) > 1:
        i = draw(st.integers(0, len(key) - 1))
        return key[:i] + key[i + 1:]
    if kind == "swap" and len(key) > 2:
        i = draw(st.integers(0, len(key) - 2))
        return key[:i] + key[i + 1] + key[i] + key[i + 2:]
    if kind == "case":
        return key.upper()
    if kind == "extra":
        return key + draw(st.sampled_from([".x", "_", ".0", ".", "s"]))
    return draw(st.sampled_from(["model", "moe", "guards", "training"])) + "." + \
        key.rsplit(".", 1)[-1]


@st.composite
def override_keys(draw):
    kind = draw(st.sampled_from(["known", "mutated", "layer", "text"]))
    if kind == "known":
        return draw(st.sampled_from(KEYS))
    if kind == "mutated":
        return _mutated(draw(st.sampled_from(KEYS)), draw)
    if kind == "layer":
        layer = draw(st.integers(-2, 6))
        field = draw(st.sampled_from(["topk", "num_experts", "capacity_factor", "tpk",
                                      "score_function", "ffn_hidden_size"]))
        return f"moe.layer_overrides.{layer}.{field}"
    return draw(st.text(max_size=16))


values = st.one_of(st.sampled_from(YAML_VALUES), st.integers(-10**6, 10**6).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.text(max_size=20))
overrides = st.one_of(st.builds(lambda k, v: f"{k}={v}", override_keys(), values),
                      st.text(max_size=30))


def _config_or_error(extra: list[str]):
    """The config (and its Megatron TransformerConfig) or the MegaMoEError the input gives."""
    try:
        config = load_config(TINY, extra)
        transformer_config(config, on_cuda=False, bf16=False)
        return config
    except MegaMoEError as err:
        assert "\n" not in str(err) and str(err)
        return err


@FUZZ
@given(st.lists(overrides, min_size=1, max_size=4))
def test_overrides_give_a_config_or_a_config_error(extra):
    _config_or_error(extra)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9),
                    st.floats(allow_nan=True), st.text(max_size=10))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.text(max_size=8),
                                                           st.integers(-3, 8)), inner,
                                                 max_size=4)), max_leaves=12)


@st.composite
def config_documents(draw):
    """The tiny config with sections and keys replaced, added or removed at random."""
    raw = yaml.safe_load(TINY.read_text())
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(KEYS + ["bogus.key", "model", "moe"]))
        section, _, leaf = key.partition(".")
        action = draw(st.sampled_from(["set", "delete", "section"]))
        if action == "section":
            raw[section] = draw(documents)
        elif action == "delete":
            if isinstance(raw.get(section), dict):
                raw[section].pop(leaf, None)
            else:
                raw.pop(section, None)
        else:
            if not isinstance(raw.get(section), dict):
                raw[section] = {}
            raw[section][leaf or "x"] = draw(documents)
    return raw


@FUZZ
@given(st.one_of(config_documents(), documents))
def test_config_files_give_a_config_or_a_config_error(tmp_path_factory, document):
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    try:
        config = load_config(path)
        transformer_config(config, on_cuda=False, bf16=False)
    except MegaMoEError as err:
        assert "\n" not in str(err)


@FUZZ
@given(st.text(max_size=200))
def test_any_config_text_gives_a_config_or_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except MegaMoEError as err:
        assert "\n" not in str(err)


flags = st.one_of(st.sampled_from(["--config", "--help", "-h", "--conf", "--config=", "-x",
                                   "--", "=", str(TINY), "configs/missing.yaml"]), overrides)


@FUZZ
@given(st.lists(flags, max_size=5))
@example(["--config", "", "\n"])  # an unrecognised newline argument: escaped, still one line
def test_command_lines_run_or_exit_2_with_one_line(tmp_path_factory, capsys, monkeypatch,
                                                   argv):
    monkeypatch.setattr(loop, "run", lambda config: 0)  # the parsing and checks, no training
    out = tmp_path_factory.mktemp("fuzz-run")
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(TINY), f"output_dir={out}", *argv])
    captured = capsys.readouterr()
    if exit_info.value.code == 2:
        assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, \
            captured.err
    else:
        assert exit_info.value.code == 0, captured.err
        assert "Traceback" not in captured.err


@settings(max_examples=2 if QUICK else 6, deadline=None,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(st.lists(overrides, min_size=1, max_size=3))
def test_failing_inputs_through_the_real_cli(extra):
    assume(not any("\x00" in arg for arg in extra))  # no command line can carry a NUL
    assume(isinstance(_config_or_error(extra), MegaMoEError))
    done = warm_launcher.run([sys.executable, "-m", "megamoe.train", "--config", str(TINY),
                              "output_dir=/nonexistent/never-written", *extra], cwd=REPO, env=env(),
                             capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
