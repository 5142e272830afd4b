"""memlab.checkpoint.enable: memlab's checkpoint on a transformers model's decoder layers."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from memlab.checkpoint import disable, enable  # noqa: E402
from memlab.models import decoder_layers, tiny_llama  # noqa: E402
from memlab.profiler import MemoryTracker  # noqa: E402


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return tiny_llama().train()


def _step(model, x, **kw):
    model.zero_grad(set_to_none=True)
    with MemoryTracker(model) as t:
        loss = model(input_ids=x, labels=x, **kw).loss
        loss.backward()
    acts = max(e.bytes["activations"] for e in t.timeline)
    return loss.detach(), acts, [p.grad.clone() for p in model.parameters()]


def test_same_gradients_bit_for_bit_and_fewer_activations(base):
    x = torch.randint(0, base.config.vocab_size, (2, 64))
    plain = copy.deepcopy(base)
    model = copy.deepcopy(base)
    loss0, acts0, grads0 = _step(plain, x, use_cache=False)
    assert enable(model) == list(range(base.config.num_hidden_layers))
    assert model.config.use_cache is False
    loss1, acts1, grads1 = _step(model, x)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert acts1 < 0.5 * acts0, (acts1, acts0)  # 4 layers: only their inputs are kept
    # every=2 checkpoints layers 0 and 2: in between
    assert enable(model, every=2) == [0, 2]
    _, acts2, grads2 = _step(model, x)
    assert acts1 < acts2 < acts0
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads2))
    assert disable(model) == 2 and all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_use_cache_while_training_warns_once_and_keeps_nothing_alive(base):
    x = torch.randint(0, base.config.vocab_size, (2, 64))
    model = copy.deepcopy(base)
    enable(model)
    _, acts, _ = _step(model, x)
    with pytest.warns(UserWarning, match="use_cache=True while training") as record:
        _, acts_cache, _ = _step(model, x, use_cache=True)
    assert len([w for w in record if "use_cache" in str(w.message)]) == 1  # once, not once per layer
    assert acts_cache == acts


def test_generation_under_no_grad_still_uses_the_cache(base):
    model = copy.deepcopy(base).eval()
    enable(model)
    x = torch.randint(0, base.config.vocab_size, (1, 8))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = model(input_ids=x, use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 8


def test_a_cache_holding_tokens_is_an_error_with_gradients_on(base):
    model = copy.deepcopy(base)
    x = torch.randint(0, base.config.vocab_size, (1, 8))
    with torch.no_grad():
        past = model(input_ids=x, use_cache=True).past_key_values
    enable(model)
    with pytest.raises(ValueError, match="already holds tokens"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values to cache
        model(input_ids=x, past_key_values=past, use_cache=True)


def test_transformers_checkpointing_is_turned_off_with_a_warning(base):
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with pytest.warns(UserWarning, match="transformers' gradient checkpointing was on"):
        enable(model)
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in decoder_layers(model))


def test_output_attentions_warns(base):
    model = copy.deepcopy(base)
    model.config.output_attentions = True
    with pytest.warns(UserWarning, match="output_attentions"):
        enable(model)


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2"])
def test_bad_every_names_the_argument(base, every):
    with pytest.raises(ValueError, match=r"every=.* is invalid; allowed: an int >= 1"):
        enable(copy.deepcopy(base), every=every)


def test_not_a_module():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        enable("llama")
