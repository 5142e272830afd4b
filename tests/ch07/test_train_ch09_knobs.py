"""memlab.train runs chapter 09's knobs: the chunked and the fused loss (memlab.loss) and the optimizer step in
backward (memlab.offload.optimizer_in_backward). Each stack's measured peak is the planner's traced figure for it
(memlab.plan.estimate_stack with the trainer's loss) and the fake trace of the trainer's own loop
(estimate_stack_peak); the losses are the plain stack's (bitwise for the step in backward); a checkpoint
written by one optimizer form restores into the other."""
from __future__ import annotations

import pytest
import torch

from memlab.plan import Stack
from memlab.train import BudgetTrainer, estimate_stack_peak, measure_stack_peak

transformers = pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

from memlab.models import TinyGPT, TinyGPTConfig, tiny_llama_config  # noqa: E402
from memlab.plan.stacks import estimate_stack  # noqa: E402

# the loss sets the peak: a 4-layer Llama, batch 2 x 128 tokens
LOSS_BOUND = dict(cfg=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, max_position_embeddings=256,
                           attn_implementation="sdpa"), T=128, mb=2)
# the end of backward sets the peak (large vocabulary and width, 1 x 16 tokens): the whole gradient matters
GRAD_BOUND = dict(cfg=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, max_position_embeddings=256,
                           attn_implementation="sdpa", vocab_size=2048), T=16, mb=1)


def _data(vocab: int, mb: int, T: int):
    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, vocab, (mb, T), generator=g), torch.randint(0, vocab, (mb, T), generator=g)
    return batch


@pytest.mark.parametrize("setup,knobs", [
    (LOSS_BOUND, dict(loss="fused")),
    (LOSS_BOUND, dict(loss="chunked")),
    (LOSS_BOUND, dict(loss="fused", checkpointing="every-k", ckpt_every=2)),
    (GRAD_BOUND, dict(optimizer_in_backward=True)),
    (GRAD_BOUND, dict(optimizer_in_backward=True, loss="fused", checkpointing="full")),
    (GRAD_BOUND, dict(optimizer_in_backward=True, optimizer="adamw-fused")),
])
def test_chapter09_stacks_run_and_measure_what_the_planner_traced(setup, knobs):
    cfg = tiny_llama_config(**setup["cfg"])
    T, mb = setup["T"], setup["mb"]
    st = Stack(micro_batch=mb, **knobs)
    plain = Stack(micro_batch=mb, checkpointing=st.checkpointing, ckpt_every=st.ckpt_every, optimizer=st.optimizer)
    data = _data(cfg.vocab_size, mb, T)
    real = measure_stack_peak(lambda: LlamaForCausalLM(cfg), st, T, data=data)
    fake = estimate_stack_peak(lambda: LlamaForCausalLM(cfg), st, T, vocab_size=cfg.vocab_size)
    planned = estimate_stack(cfg, st, seq_len=T, device="cpu", loss="memlab").peak_bytes
    assert fake == real, (st, fake, real)  # the trainer's loop traced on fake tensors: to the byte
    if st.loss == "fused":
        # the estimator calls model(input_ids=x, labels=x): transformers' shift makes a (mb, T + 1) int64 copy of the
        # labels; the trainer hands its targets over as they are (shift_labels=y)
        assert 0 <= planned - real <= mb * (T + 1) * 8, (st, planned, real)
    else:
        assert planned == real, (st, planned, real)
    base = measure_stack_peak(lambda: LlamaForCausalLM(cfg), plain, T, data=data)
    if st.loss == "chunked":
        assert real == base  # chunks through autograd keep every chunk's log-probabilities: nothing saved
    else:
        assert real < base  # the logits never made whole, or the whole gradient never alive


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def _run(stacks, steps=3, budget=None, **kw) -> BudgetTrainer:
    t = BudgetTrainer(_llama(), budget, stacks=stacks, effective_batch=4, seq_len=32, **kw)
    t.train(steps)
    return t


def test_losses_are_the_plain_stacks():
    base = _run([Stack(micro_batch=4)]).losses
    fused_opt = _run([Stack(micro_batch=4, optimizer="adamw-fused")]).losses
    # one AdamW per parameter, stepped in backward: the same update as one AdamW over all of them
    assert _run([Stack(micro_batch=4, optimizer_in_backward=True)]).losses == base
    assert _run([Stack(micro_batch=4, optimizer="adamw-fused", optimizer_in_backward=True)]).losses == fused_opt
    for loss in ("fused", "chunked"):  # the same mean cross-entropy of the same targets, summed in another order
        got = _run([Stack(micro_batch=4, loss=loss)]).losses
        assert max(abs(a - b) for a, b in zip(got, base)) < 1e-5, (loss, got, base)
        assert got != [] and all(abs(a - b) < 1e-5 for a, b in zip(got, base))


def test_a_checkpoint_of_the_step_in_backward_restores_into_one_optimizer_and_back(tmp_path):
    inb, plain = Stack(micro_batch=4, optimizer_in_backward=True), Stack(micro_batch=4)
    whole = _run([inb], steps=4).losses
    first = BudgetTrainer(_llama(), None, stacks=[inb], effective_batch=4, seq_len=32, ckpt_dir=tmp_path)
    first.train(2)
    # a new trainer that runs the plain stack resumes from the in-backward checkpoint (saved stack not in its list)
    second = BudgetTrainer(_llama(seed=1), None, stacks=[plain], effective_batch=4, seq_len=32, ckpt_dir=tmp_path)
    assert second.step == 2
    assert second.train(3)[2:] == whole[2:3]
    third = BudgetTrainer(_llama(seed=2), None, stacks=[inb], effective_batch=4, seq_len=32, ckpt_dir=tmp_path)
    assert third.step == 3 and third.train(4) == whole  # and back: every loss bitwise the uninterrupted run's


def test_an_oom_backs_off_from_a_chapter09_stack_and_restores(tmp_path):
    a = Stack(micro_batch=4, loss="fused", optimizer_in_backward=True)
    b = Stack(micro_batch=2, grad_accum=2, loss="fused", checkpointing="full")
    solo_a, solo_b = _run([a], steps=2), _run([b], steps=2)
    assert max(solo_b.step_peaks) < max(solo_a.step_peaks)
    budget = (max(solo_a.step_peaks) + max(solo_b.step_peaks)) // 2
    t = _run([a, b], steps=2, budget=budget, ckpt_dir=tmp_path)
    # a's first step fits (no AdamW state yet); its second does not: back to the checkpoint of step 1, on b
    assert [(e.step, e.from_stack, e.to_stack, e.restored) for e in t.backoffs] == [(1, a, b, 1)]
    assert t.peak_bytes <= budget and "exceeded" in t.backoffs[0].reason
    assert t.losses[0] == solo_a.losses[0] and t.step_peaks[1:] == solo_b.step_peaks[1:]
    assert abs(t.losses[1] - solo_b.losses[1]) < 1e-5  # step 0 ran with a: the same update up to rounding


def test_chapter09_losses_need_a_transformers_causal_lm():
    torch.manual_seed(0)
    tiny = TinyGPT(TinyGPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))
    for loss in ("fused", "chunked"):
        with pytest.raises(ValueError, match=rf"stacks\[1\]\.loss='{loss}'.*allowed for this model: loss='default'"):
            BudgetTrainer(tiny, None, stacks=[Stack(micro_batch=4), Stack(micro_batch=4, loss=loss)],
                          effective_batch=4, seq_len=32)
    # the step in backward runs on any model; with accumulation it is no Stack at all
    assert len(BudgetTrainer(tiny, None, stacks=[Stack(micro_batch=4, optimizer_in_backward=True)], effective_batch=4,
                             seq_len=32).train(1)) == 1
    with pytest.raises(ValueError, match="optimizer_in_backward=True is invalid with grad_accum=2"):
        Stack(micro_batch=2, grad_accum=2, optimizer_in_backward=True)


def test_run_step_is_the_step_train_runs():
    inb = Stack(micro_batch=4, loss="fused", optimizer_in_backward=True)
    whole = _run([inb], steps=2)
    t = _run([inb], steps=1)
    assert t.run_step(1).item() == whole.losses[1] and t.step == 1 and len(t.losses) == 1
    # another stack is applied for the step and the trainer's own put back
    t.run_step(2, Stack(micro_batch=2, grad_accum=2, checkpointing="full"))
    assert t._applied == inb
    with pytest.raises(ValueError, match="step=-1"):
        t.run_step(-1)
    with pytest.raises(ValueError, match=r"stacks\[0\]: micro_batch=2 x grad_accum=1 = 2"):
        t.run_step(2, Stack(micro_batch=2))
