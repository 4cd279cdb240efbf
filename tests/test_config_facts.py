"""`config_facts` reads a config's fields from its instance dict where that is what attribute
reads answer, and agrees with the attribute reads on every config class transformers has."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")

import transformers

from attn_backends.errors import IntegrationError
from attn_backends.integrations import _hf_models


def _slow(config, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(_hf_models, "_instance_key", lambda config: None)
        m.setattr(_hf_models, "_facts", {})
        return _hf_models.config_facts(config)


def _default_configs():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for name in sorted(CONFIG_MAPPING.keys()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield name, CONFIG_MAPPING[name]()
        except Exception:  # a config that needs arguments or another library
            continue


def test_every_default_config_gets_the_facts_its_attribute_reads_give(monkeypatch):
    fast_keys = 0
    for name, config in _default_configs():
        try:
            slow = _slow(config, monkeypatch)
        except IntegrationError:  # two text configs (MusicGen): refused by name both ways
            with pytest.raises(IntegrationError, match="more than one text config"):
                _hf_models.config_facts(config)
            continue
        assert _hf_models.config_facts(config) == slow, name
        fast_keys += _hf_models._instance_key(config) is not None
    assert fast_keys > 50, "the instance-dict key serves most configs"


def test_an_edited_config_gets_its_own_facts():
    config = transformers.Qwen3Config(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    assert _hf_models._instance_key(config) is not None
    first = _hf_models.config_facts(config)
    assert first.mixers == () and first.attention_layers == 2
    layer_types = config.layer_types
    assert layer_types is not None
    layer_types[1] = "linear_attention"  # in place: the list object stays the same
    edited = _hf_models.config_facts(config)
    assert edited.mixers == ("'linear_attention'",) and edited.attention_layers == 1
    config.layer_types = ["full_attention"] * 3
    config.num_hidden_layers = 3
    assert _hf_models.config_facts(config).attention_layers == 3
    config.use_repmixer_blocks = True
    assert _hf_models.config_facts(config).blind


def test_a_field_a_class_computes_is_read_through_the_class(monkeypatch):
    class Computed(transformers.PretrainedConfig):
        model_type = "computed-layers"

        @property
        def layer_types(self):
            return ["linear_attention"]

    config = Computed()
    config.__dict__["layer_types"] = ["full_attention"]  # what the property hides
    assert _hf_models._instance_key(config) is None
    assert _hf_models.config_facts(config).mixers == ("'linear_attention'",)
    assert _hf_models.config_facts(config) == _slow(config, monkeypatch)


def test_a_field_that_is_no_key_is_kept_by_its_content(monkeypatch):
    config = transformers.LxmertConfig()  # num_hidden_layers is a dict of three stacks
    assert isinstance(config.num_hidden_layers, dict)
    first = _hf_models.config_facts(config)
    assert first == _slow(config, monkeypatch)
    config.num_hidden_layers = {**config.num_hidden_layers, "language": 3}
    assert _hf_models.config_facts(config) == _slow(config, monkeypatch)


def test_a_composite_config_is_read_through_its_text_config(monkeypatch):
    config = transformers.Gemma3Config()
    assert _hf_models._instance_key(config) is None
    assert _hf_models.config_facts(config) == _slow(config, monkeypatch)


def test_a_config_of_two_text_configs_is_refused_by_name():
    config = transformers.MusicgenConfig()  # text_encoder and decoder: get_text_config() fails
    with pytest.raises(IntegrationError, match=r"Musicgen\w*: its config holds more than one"):
        _hf_models.config_facts(config)
