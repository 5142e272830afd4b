"""The BERT validation rows' model of their source's torch: before 1.11, autograd's SoftmaxBackward saved the softmax's
input beside its output (pytorch/pytorch#64000; fixed by #65242 / #66018 after 1.10's branch). ``validate._bert_cls``
builds BERT-large with that softmax (``validate._softmax_keeping_input``). Checked here on a tiny BERT, for real on
this CPU: the gradients are the plain softmax's, and what autograd saves grows by exactly one softmax input per layer
(batch x heads x seq x seq, float32, also under autocast), counted by torch's saved-tensor hooks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlab.estimate.validate import _softmax_keeping_input

B, S, HEADS, LAYERS = 2, 32, 2, 3


def _tiny_bert(patched: bool):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        num_labels=2, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64,
        vocab_size=100, attn_implementation="eager", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if patched:
        for layer in model.bert.encoder.layer:
            _softmax_keeping_input(layer.attention.self)
    return model


def _saved_bytes(model, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward (torch's saved_tensors_hooks)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    import contextlib

    from memlab.estimate.cuda_rules import cuda_semantics

    x = torch.randint(0, 100, (B, S), generator=torch.Generator().manual_seed(1))
    # under autocast, CUDA's op lists (the rows' target: softmax in float32), as the estimator traces them on a CPU
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            cuda_semantics() if autocast else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        model(input_ids=x, labels=torch.zeros(B, dtype=torch.long)).loss
    return sum(seen.values())


@pytest.mark.parametrize("autocast", [False, True])
def test_one_more_float32_softmax_input_is_saved_per_layer(autocast):
    extra = _saved_bytes(_tiny_bert(True), autocast) - _saved_bytes(_tiny_bert(False), autocast)
    assert extra == LAYERS * B * HEADS * S * S * 4, extra


def test_the_gradients_are_the_plain_softmax_ones():
    x = torch.randint(0, 100, (B, S), generator=torch.Generator().manual_seed(2))
    grads = []
    for patched in (False, True):
        model = _tiny_bert(patched)
        model(input_ids=x, labels=torch.ones(B, dtype=torch.long)).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_the_functional_softmax_is_restored_even_after_an_error():
    plain = F.softmax
    model = _tiny_bert(True)
    with pytest.raises(Exception):
        model.bert.encoder.layer[0].attention.self(torch.zeros(1, 4, 7))  # 7 is no multiple of the head size
    assert F.softmax is plain
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert F.softmax is plain
