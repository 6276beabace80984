"""Tests for stepquant.families: every registry entry is complete and consistent with transformers, so a new
family is one entry in FAMILIES (these tests then cover it), and the one layer-index function agrees with
what transformers builds."""

from __future__ import annotations

import pytest

from stepquant.families import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    family_for,
    get_family,
    language_model,
    layer_types,
    linear_layers,
    shape_from_config,
)
from stepquant.recurrence import MODES

MODEL_TYPES = [(family.name, model_type) for family in FAMILIES.values() for model_type in family.model_types]
IDS = [model_type for _, model_type in MODEL_TYPES]


def minimal_config(model_type: str) -> dict:
    """The smallest config of a model type: its model_type (a wrapper's language model in text_config)."""
    family = family_for(model_type)
    if model_type in family.wrappers:
        return {"model_type": model_type, "text_config": {"model_type": family.text_type(model_type)}}
    return {"model_type": model_type}


def test_registry_lists_every_model_type_once():
    listed = [t for family in FAMILIES.values() for t in family.model_types]
    assert len(listed) == len(set(listed)) and tuple(listed) == SUPPORTED_MODEL_TYPES
    for name, family in FAMILIES.items():
        assert family.name == name and name in MODES, f"{name}: the recurrence has no mode of that name"
        assert family.types and get_family(name) is family


@pytest.mark.parametrize("family_name, model_type", MODEL_TYPES, ids=IDS)
def test_each_model_type_has_its_transformers_mixer_and_recurrence(family_name, model_type):
    pytest.importorskip("transformers")
    family = family_for(model_type)
    assert family is FAMILIES[family_name]
    module = family.modeling_module(model_type)
    assert isinstance(getattr(module, family.model_type(model_type).mixer_class), type)
    for name in family.recurrence_functions:
        assert callable(getattr(module, name)), f"{module.__name__} has no {name}"


@pytest.mark.parametrize("family_name, model_type", MODEL_TYPES, ids=IDS)
def test_defaults_alone_give_a_shape(family_name, model_type):
    """A config holding only its model_type parses with the entry's defaults (hub configs omit fields)."""
    shape = shape_from_config(minimal_config(model_type))
    assert shape.family is FAMILIES[family_name] and shape.model_type == model_type
    kinds = layer_types(minimal_config(model_type))
    assert shape.layer_indices == linear_layers(minimal_config(model_type))
    assert (shape.linear_layers, shape.full_attention_layers) == (kinds.count("linear_attention"),
                                                                  kinds.count("full_attention"))


@pytest.mark.parametrize("family_name, model_type", MODEL_TYPES, ids=IDS)
def test_defaults_are_those_of_transformers(family_name, model_type):
    """The entry's defaults equal the transformers config class's, field by field."""
    transformers = pytest.importorskip("transformers")
    family = FAMILIES[family_name]
    config = transformers.AutoConfig.for_model(model_type)
    text = config.get_text_config(decoder=True)
    for key, value in family.model_type(model_type).defaults.items():
        assert getattr(text, key) == value, f"{model_type}.{key}: transformers has {getattr(text, key)!r}"
    expected = tuple(i for i, kind in enumerate(text.layer_types) if kind == "linear_attention")
    assert linear_layers(config) == expected
    assert language_model(config).fields["model_type"] == family.text_type(model_type)


def test_linear_layers_match_the_cache_transformers_builds():
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import LinearAttentionLayer

    for model_type in ("qwen3_5_text", "kimi_linear"):
        config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=9)
        cache = transformers.DynamicCache(config=config)
        built = tuple(i for i, layer in enumerate(cache.layers) if type(layer) is LinearAttentionLayer)
        assert linear_layers(config) == built and built


def test_unknown_names_are_clear_errors():
    message = r"unsupported model_type 'llama'; supported: qwen3_next, .* kimi_linear \(a new model family is"
    with pytest.raises(ValueError, match=message):
        family_for("llama")
    with pytest.raises(ValueError, match="family must be one of 'gdn', 'kda', got 'mamba'"):
        get_family("mamba")
