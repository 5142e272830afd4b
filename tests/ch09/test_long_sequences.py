"""Chapter 09 beyond the loss: the inputs of checkpointed layers offloaded to the host
(memlab.checkpoint.offload_checkpoints), the optimizer step in backward (memlab.offload.optimizer_in_backward),
and both with the chunked and fused losses in the estimator (fake == real to the byte), the CLI and the planner
(one configuration, one answer)."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from memlab import checkpoint as C
from memlab import estimate as E
from memlab import plan as P
from memlab.cli import estimate as estimate_cli
from memlab.models import TinyGPT, TinyGPTConfig, tiny_llama, tiny_llama_config
from memlab.offload import OptimizerInBackward, optimizer_in_backward
from memlab.profiler import MemoryTracker, allocator_peak

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=2048)
SMALL3 = {**SMALL, "num_hidden_layers": 3}


@pytest.fixture(autouse=True)
def _trace_cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memlab-traces"))


def _llama(layers: int = 3, **kw):
    torch.manual_seed(0)
    return tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, **kw)


def _grads(model, x, seed: int = 1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout draws the same masks in both runs
    loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- offloaded checkpoint inputs
def test_offloaded_checkpoints_give_plain_checkpointing_gradients_bitwise():
    plain = _llama(attention_dropout=0.1)
    off = copy.deepcopy(plain)
    x = torch.randint(0, 256, (2, 16))
    C.enable(plain)
    handle = C.offload_checkpoints(off)
    l1, g1 = _grads(plain, x)
    l2, g2 = _grads(off, x)
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    st = handle.stats
    one = 2 * 16 * 64 * 4  # one layer's input: batch x seq x hidden fp32
    assert handle.layers == [0, 1, 2]
    assert (st.offloaded_tensors, st.offloaded_bytes, st.fetched_bytes) == (3, 3 * one, 3 * one)
    assert st.prefetched == 2  # each layer but the first fetched the one before it ahead of need
    assert st.peak_host_bytes == 3 * one and st.host_bytes == 0  # all three alive after forward, freed by backward
    assert st.same_memory  # on a CPU the host is the device: said, not hidden


def test_offloaded_checkpoints_on_tinygpt_with_dropout():
    torch.manual_seed(0)
    a = TinyGPT(TinyGPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64, dropout=0.1))
    b = copy.deepcopy(a)
    x = torch.randint(0, 64, (2, 16))

    def grads(m):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        m(x, x)[1].backward()
        return [p.grad.clone() for p in m.parameters()]

    C.enable(a)
    C.offload_checkpoints(b, prefetch=False)
    assert all(torch.equal(p, q) for p, q in zip(grads(a), grads(b)))


def test_remove_restores_the_model_and_bad_arguments_are_named():
    model = _llama(layers=2)
    ref = copy.deepcopy(model)
    x = torch.randint(0, 256, (1, 8))
    handle = C.offload_checkpoints(model)
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    handle.remove()
    assert not any("forward" in layer.__dict__ for layer in model.model.layers) and handle.layers == []
    assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
    with pytest.raises(ValueError, match=r"pin_memory='yes' is invalid; allowed: True or False"):
        C.offload_checkpoints(model, pin_memory="yes")
    with pytest.raises(ValueError, match=r"host_device='cuda' is invalid"):
        C.offload_checkpoints(model, host_device="cuda")
    with pytest.raises(TypeError, match="model"):
        C.offload_checkpoints(object())
    C.offload_checkpoints(model, host_device="meta")
    with pytest.raises(ValueError, match="host_device='meta' keeps no values"):
        model(input_ids=x, labels=x).loss.backward()


def test_a_kv_cache_holding_tokens_is_refused():
    from transformers import DynamicCache

    model = _llama(layers=2)
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        cache = model(input_ids=x, use_cache=True).past_key_values
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 8
    C.offload_checkpoints(model)
    with pytest.raises(ValueError, match="KV cache that already holds tokens"):
        model(input_ids=x, past_key_values=cache, use_cache=True)


def test_on_a_cpu_the_offload_saves_nothing_by_the_allocator():
    # honest on a CPU: the host copy replaces the input in the same memory; the allocator's own events agree
    x = torch.randint(0, 256, (2, 64))
    peaks = {}
    for kind in ("plain", "offload"):
        model = _llama(layers=4)
        C.enable(model) if kind == "plain" else C.offload_checkpoints(model)
        _grads(model, x)  # warm
        model.zero_grad(set_to_none=True)
        peaks[kind] = allocator_peak(lambda m=model: m(input_ids=x, labels=x).loss.backward())[0]
    one = 2 * 64 * 64 * 4
    assert abs(peaks["offload"] - peaks["plain"]) <= one, peaks  # at most the one copy in flight


def test_a_cuda_target_keeps_the_inputs_on_the_host():
    # the estimator traces the offload itself (host copies as shapes on a CUDA target): the device loses every
    # layer input at the backward peak; the host holds all of them, counted apart
    kw = dict(config_overrides={**SMALL, "vocab_size": 512}, batch_size=2, seq_len=256, dtype="bf16",
              checkpointing=True, extrapolate=False)
    plain = E.estimate_training_memory("llama-2-7b", **kw)
    off = E.estimate_training_memory("llama-2-7b", offload_checkpoints=True, **kw)
    one = 2 * 256 * 64 * 4  # fp32 residual stream under bf16 autocast
    assert off.host_breakdown == {"offloaded checkpoint inputs (pinned, at most)": 4 * one}
    assert off.host_bytes == 4 * one
    assert plain.peak_bytes - off.peak_bytes >= 2 * one
    assert off.offload_checkpoints and "inputs offloaded" in off.describe()
    assert any("offload_checkpoints" in n for n in off.notes)


@pytest.mark.cuda
def test_offloaded_checkpoints_on_cuda_lower_max_memory_allocated():
    dev = torch.device("cuda")
    x = torch.randint(0, 256, (4, 1024), device=dev)
    out = {}
    for kind in ("plain", "offload"):
        model = _llama(layers=6).to(dev)
        handle = C.enable(model) if kind == "plain" else C.offload_checkpoints(model)
        _grads(model, x)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, grads = _grads(model, x)
        torch.cuda.synchronize()
        out[kind] = (torch.cuda.max_memory_allocated() - base, loss, grads, handle)
    one = 4 * 1024 * 64 * 4
    assert out["plain"][0] - out["offload"][0] >= 3 * one, (out["plain"][0], out["offload"][0])
    torch.testing.assert_close(out["plain"][1], out["offload"][1])  # CUDA's embedding backward may sum in any order
    for a, b in zip(out["plain"][2], out["offload"][2]):
        torch.testing.assert_close(a, b)
    # the handle's counts run over both backward passes (the warm-up and the measured one): 6 layers offloaded and
    # 5 fetched ahead in each (the H200 run of 2026-11-28 counted 12 and 10; this test had asserted one pass's 5)
    st = out["offload"][3].stats
    assert (st.offloaded_tensors, st.prefetched, st.offloaded_bytes) == (2 * 6, 2 * 5, 2 * 6 * one)
    assert not st.same_memory


# ----------------------------------------------------------------------------- the optimizer step in backward
def _tied_with_a_frozen_weight():
    model = _llama(layers=2, tie_word_embeddings=True)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    return model


def test_optimizer_in_backward_equals_adamw_bitwise_frozen_and_tied():
    ref = _tied_with_a_frozen_weight()
    model = copy.deepcopy(ref)
    x = torch.randint(0, 256, (2, 16))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    handle = optimizer_in_backward(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one parameter
    assert len(handle.optimizers) == len(trainable) == len(list(model.parameters())) - 1  # the frozen one skipped
    for step in range(3):
        opt.zero_grad()
        ref(input_ids=x, labels=x).loss.backward()
        opt.step()
        handle.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        assert all(p.grad is None for p in model.parameters())  # every gradient freed in backward
        assert handle.steps == (step + 1) * len(trainable)  # the tied weight stepped once per backward
        handle.step()
        for p, q in zip(ref.parameters(), model.parameters()):
            assert torch.equal(p, q)
    assert isinstance(handle, torch.optim.Optimizer) and isinstance(handle, OptimizerInBackward)


def test_accumulation_is_refused_and_global_norm_clipping_sees_no_gradient():
    model = _llama(layers=2)
    x = torch.randint(0, 256, (2, 16))
    handle = optimizer_in_backward(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    handle.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    # clipping by the global norm after backward: nothing left to clip, silently a no-op
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
    with pytest.raises(RuntimeError, match=r"got a second gradient before step\(\): gradient accumulation is impossible"):
        model(input_ids=x, labels=x).loss.backward()
    handle.step()
    model(input_ids=x, labels=x).loss.backward()  # a new step: fine
    # without step()/zero_grad() marks (a loop of backward calls only) nothing is refused
    other = _llama(layers=1)
    h2 = optimizer_in_backward(other.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    for _ in range(2):
        other(input_ids=x, labels=x).loss.backward()
    assert h2.steps == 2 * len(h2.optimizers)


def test_state_dict_round_trip_and_lr_schedulers():
    model = _llama(layers=1)
    x = torch.randint(0, 256, (2, 16))
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)  # noqa: E731
    handle = optimizer_in_backward(model, make)
    model(input_ids=x, labels=x).loss.backward()
    handle.step()
    twin = copy.deepcopy(model)
    h2 = optimizer_in_backward(twin, make)
    h2.load_state_dict(copy.deepcopy(handle.state_dict()))  # torch's load_state_dict shares the tensors it is given
    for m in (model, twin):
        m(input_ids=x, labels=x).loss.backward()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert set(handle.state_dict()) == {n for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="missing"):
        h2.load_state_dict({})
    torch.optim.lr_scheduler.LambdaLR(h2, lambda s: 0.5)  # a scheduler sets the lr of each parameter's optimizer
    assert {g["lr"] for opt in h2.optimizers.values() for g in opt.param_groups} == {5e-3}
    handle.remove()
    model(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # hooks gone: gradients accumulate again


def test_optimizer_in_backward_bad_arguments():
    model = _llama(layers=1)
    with pytest.raises(TypeError, match="make_optimizer"):
        optimizer_in_backward(model, "adamw")
    with pytest.raises(TypeError, match="returned dict"):
        optimizer_in_backward(model, lambda ps: {})
    other = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="exactly the one parameter"):
        optimizer_in_backward(model, lambda ps: torch.optim.SGD([*ps, other], lr=0.1))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        optimizer_in_backward(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(TypeError, match="one tensor"):
        optimizer_in_backward(other, lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_the_whole_gradient_never_exists_by_tracker_and_allocator():
    # a model whose weights dominate (short sequence): the normal step's peak holds every gradient at once
    x = torch.randint(0, 512, (1, 8))
    cfg = dict(layers=2, hidden_size=256, intermediate_size=512, vocab_size=512)
    out = {}
    for kind in ("normal", "in backward"):
        torch.manual_seed(0)
        model = tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512)
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)  # noqa: E731
        opt = make(list(model.parameters())) if kind == "normal" else optimizer_in_backward(model, make)

        def step(m=model, o=opt):
            o.zero_grad(set_to_none=True)
            m(input_ids=x, labels=x).loss.backward()
            o.step()

        step()  # the optimizer state exists from here on
        tracker = MemoryTracker(model, opt)
        with tracker:
            step()
        out[kind] = (tracker.peak_bytes, allocator_peak(step)[0])
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    del cfg
    for i, counter in enumerate(("tracker", "allocator")):
        saved = out["normal"][i] - out["in backward"][i]
        assert saved >= grad_bytes // 2, (counter, out, grad_bytes)


# ----------------------------------------------------------------------------- the estimator: fake == real
def _tiny():
    return tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=2048)


@pytest.mark.parametrize("kw", [
    dict(loss="chunked"),
    dict(loss="fused"),
    dict(loss="fused", checkpointing=True),
    dict(checkpointing=True, offload_checkpoints=True),
    dict(optimizer_in_backward=True),
    dict(loss="fused", checkpointing=True, offload_checkpoints=True, optimizer_in_backward=True, dtype="fp32"),
    dict(loss="fused", optimizer_in_backward=True, adapter="lora", lora_r=4),
])
def test_fake_trace_equals_real_step(kw):
    kw = {"dtype": "bf16", **kw}
    fake = E.estimate_training_memory(_tiny, batch_size=2, seq_len=64, device="cpu", kernel_scratch=False, **kw)
    real = E.measure_training_memory(_tiny, batch_size=2, seq_len=64, device="cpu", **kw)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert fake.phase_peaks == real.phase_peaks and fake.breakdown_end == real.breakdown_end


def _big_vocab():
    return tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=32000)


def test_where_the_loss_sets_the_peak_chunked_keeps_the_log_probabilities_and_fused_keeps_a_tile():
    # a small Llama with a 32k vocabulary, 4,096 tokens, every block checkpointed: the loss sets the peak
    kw = dict(batch_size=4, seq_len=1024, device="cpu", dtype="bf16", kernel_scratch=False, checkpointing=True)
    hf, chunked, fused = (E.estimate_training_memory(_big_vocab, loss=loss, **kw)
                          for loss in ("default", "chunked", "fused"))
    assert hf.loss == "hf" and chunked.loss == "chunked" and fused.loss == "fused"
    assert "fused" in fused.step and "chunked_cross_entropy" in chunked.step
    logits = 4 * 1024 * 32000  # tokens x vocabulary
    tile = 1024 * 32000 * 4  # one 1,024-token chunk in fp32
    # transformers' loss keeps the model's bf16 logits besides its fp32 log-probabilities; the chunked one does not
    assert hf.peak_bytes - chunked.peak_bytes >= 2 * logits
    # autograd keeps every chunk's fp32 log-probabilities: a whole fp32 copy of the logits, which the fused loss
    # never makes (it keeps one chunk's tile while it runs)
    assert chunked.breakdown["activations"] >= 4 * logits > fused.breakdown["activations"]
    assert chunked.peak_bytes - fused.peak_bytes >= 4 * logits - tile


def test_the_optimizer_in_backward_is_traced_in_its_steady_state():
    # the fast warm-up (zero gradients, one opt.step()) never runs the per-parameter steps: a full warm-up
    # step does, so the tracked step starts with every parameter's optimizer state alive
    est = E.estimate_training_memory(_tiny, batch_size=2, seq_len=16, device="cpu", dtype="fp32",
                                     optimizer_in_backward=True, extrapolate=False)
    n = sum(p.numel() for p in _tiny().parameters())
    first = est.tracker.timeline[0].bytes
    assert first["optimizer"] == est.breakdown_end["optimizer"] >= 8 * n  # two fp32 moments per weight
    assert est.breakdown_end["gradients"] == 0 and est.optimizer_in_backward
    assert "per parameter in backward" in est.optimizer_impl


def test_step_spec_spellings_and_refusals():
    assert E.StepSpec(batch_size=1, seq_len=8, loss="default") == E.StepSpec(batch_size=1, seq_len=8, loss="auto")
    with pytest.raises(ValueError, match=r"offload_checkpoints=True is invalid with checkpointing=False"):
        E.StepSpec(batch_size=1, seq_len=8, offload_checkpoints=True)
    with pytest.raises(ValueError, match=r"optimizer_in_backward=True is invalid with grad_accum=2"):
        E.StepSpec(batch_size=1, seq_len=8, optimizer_in_backward=True, grad_accum=2)
    with pytest.raises(ValueError, match=r"optimizer='offload-adamw'"):
        E.StepSpec(batch_size=1, seq_len=8, optimizer_in_backward=True, optimizer="offload-adamw")
    with pytest.raises(ValueError, match=r"zero_stage=2"):
        E.StepSpec(batch_size=1, seq_len=8, optimizer_in_backward=True, world_size=2, zero_stage=2)
    with pytest.raises(ValueError, match=r"optimizer_in_backward=1 is invalid; allowed: True or False"):
        E.StepSpec(batch_size=1, seq_len=8, optimizer_in_backward=1)
    gpt = lambda: TinyGPT(TinyGPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, vocab_size=64))  # noqa: E731
    with pytest.raises(ValueError, match=r"loss='fused' needs a transformers model; TinyGPT is not one"):
        E.estimate_training_memory(gpt, batch_size=1, seq_len=8, loss="fused")
    with pytest.raises(ValueError, match=r"loss='fast' is invalid"):
        E.estimate_training_memory(_tiny, batch_size=1, seq_len=8, loss="fast")


def test_extrapolation_equals_the_full_trace():
    kw = dict(config_overrides={**SMALL, "num_hidden_layers": 7}, batch_size=2, seq_len=64, dtype="bf16",
              checkpointing=True, loss="fused", offload_checkpoints=True, optimizer_in_backward=True)
    ext = E.estimate_training_memory("llama-2-7b", **kw)
    full = E.estimate_training_memory("llama-2-7b", extrapolate=False, **kw)
    assert ext.extrapolated_from and not full.extrapolated_from
    assert (ext.peak_bytes, ext.breakdown, ext.phase_peaks, ext.host_breakdown) == (
        full.peak_bytes, full.breakdown, full.phase_peaks, full.host_breakdown)


# ----------------------------------------------------------------------------- one configuration, one answer
def _cli_peak(argv, capsys) -> int:
    assert estimate_cli.main(argv) == 0
    out = capsys.readouterr().out
    return int(re.search(r"peak: ([\d,]+) bytes of tensors", out).group(1).replace(",", ""))


@pytest.mark.parametrize("loss, in_backward", [("fused", True), ("default", True), ("fused", False)])
def test_api_cli_and_plan_agree_to_the_byte(loss, in_backward, capsys):
    api = E.estimate_training_memory("llama-2-7b", config_overrides=SMALL3, batch_size=2, seq_len=32, dtype="bf16",
                                     checkpointing=True, loss=loss, optimizer_in_backward=in_backward)
    argv = ["llama-2-7b", "--batch-size", "2", "--seq-len", "32", "--checkpointing", "--loss",
            "auto" if loss == "default" else loss]
    for k, v in SMALL3.items():
        argv += ["--set", f"{k}={v}"]
    cli = _cli_peak(argv + (["--optimizer-in-backward"] if in_backward else []), capsys)
    stack = P.Stack(precision="bf16-mixed", checkpointing="full", micro_batch=2, loss=loss,
                    optimizer_in_backward=in_backward)
    planned = P.estimate_stack("llama-2-7b", stack, seq_len=32, config_overrides=SMALL3)
    assert api.peak_bytes == cli == planned.peak_bytes
    assert api.breakdown == planned.breakdown and api.phase_peaks == planned.phase_peaks


def test_cli_options_and_their_errors(capsys):
    base = ["llama-2-7b", "--batch-size", "1", "--seq-len", "16"]
    for k, v in SMALL3.items():
        base += ["--set", f"{k}={v}"]
    assert estimate_cli.main(base + ["--offload-checkpoints"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "offload_checkpoints=True is invalid with checkpointing=False" in err
    assert estimate_cli.main(base + ["--checkpointing", "--offload-checkpoints", "--loss", "chunked"]) == 0
    out = capsys.readouterr().out
    assert "(inputs offloaded)" in out and "chunked loss" in out and "host:" in out
    with pytest.raises(SystemExit):
        estimate_cli.main(base + ["--loss", "default"])  # the CLI's choices are the estimator's LOSSES


def test_suggestions_try_the_chapter_09_techniques():
    kw = dict(config_overrides=SMALL3, batch_size=2, seq_len=512, dtype="bf16", checkpointing=True)
    base = E.estimate_training_memory("llama-2-7b", **kw)
    assert base.peak_phase == "backward"  # the loss's fp32 copies of the logits set the peak
    rows = {s.technique.split(" (")[0]: s for s in E.suggestions(base, "llama-2-7b", config_overrides=SMALL3)}
    fused = rows["fused linear cross-entropy"]
    assert fused.how == "traced" and fused.peak_bytes < base.peak_bytes and "--loss fused" in fused.command
    assert "--offload-checkpoints" in rows["offloaded checkpoint inputs"].command
    assert "--optimizer-in-backward" in rows["optimizer step in backward"].command


# ----------------------------------------------------------------------------- the planner
def _cfg(vocab: int = 4096):
    return tiny_llama_config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256, vocab_size=vocab)


ALLOW = {"precision": ["bf16-mixed"], "checkpointing": ["full"], "optimizer": ["adamw-fused"], "adapter": ["full"],
         "loss": ["default", "fused"], "optimizer_in_backward": [False, True]}


def test_the_planner_picks_the_fused_loss_where_only_it_fits():
    cfg = _cfg()
    peak = {loss: P.estimate_stack(cfg, P.Stack(precision="bf16-mixed", checkpointing="full", optimizer="adamw-fused",
                                                micro_batch=2, loss=loss), seq_len=128, device="cpu").peak_bytes
            for loss in ("default", "fused")}
    assert peak["fused"] < peak["default"]
    tight = P.plan(cfg, peak["fused"], batch_size=2, seq_len=128, device="cpu", allow=ALLOW, top=1)
    assert tight.pick is not None and tight.pick.stack.loss == "fused" and tight.pick.peak_bytes == peak["fused"]
    roomy = P.plan(cfg, 2 * peak["default"], batch_size=2, seq_len=128, device="cpu", allow=ALLOW, top=1)
    assert roomy.pick.stack.loss == "default"  # cheaper: the fused loss recomputes the head in backward
    assert P.fidelity_tier(tight.pick.stack) == P.fidelity_tier(roomy.pick.stack) == 0
    assert "fused loss" in P.stack_label(tight.pick.stack)
    # by default (allow naming neither knob) the planner searches transformers' loss only: BudgetTrainer runs that
    default = P.plan(cfg, peak["fused"], batch_size=2, seq_len=128, device="cpu", top=1,
                     allow={k: v for k, v in ALLOW.items() if k not in ("loss", "optimizer_in_backward")})
    assert all(r.stack.loss == "default" and not r.stack.optimizer_in_backward for r in default.rows)


def test_the_planner_searches_the_step_in_backward_without_accumulation():
    stacks, _ = P.enumerate_stacks(4, 2, {**ALLOW, "optimizer": ["adamw", "offload-adamw"]}, device="cuda")
    assert not any(s.optimizer_in_backward or s.loss != "default" for s in P.enumerate_stacks(4, 2, None)[0])
    inb = [s for s in stacks if s.optimizer_in_backward]
    assert inb and all(s.grad_accum == 1 and s.optimizer != "offload-adamw" for s in inb)
    assert {s.loss for s in stacks} == {"default", "fused"}
    with pytest.raises(ValueError, match="grad_accum=2"):
        P.Stack(micro_batch=1, grad_accum=2, optimizer_in_backward=True)
    assert P.Stack(optimizer_in_backward="true").optimizer_in_backward is True
    assert P.enumerate_stacks(4, 2, {**ALLOW, "optimizer_in_backward": ["on"], "loss": "chunked"})[0][0].loss == "chunked"
    with pytest.raises(ValueError, match=r"allow\['optimizer_in_backward'\] value 'maybe' is invalid"):
        P.enumerate_stacks(4, 2, {"optimizer_in_backward": ["maybe"]})
    with pytest.raises(ValueError, match=r"allow\['loss'\] value 'hf' is invalid"):
        P.enumerate_stacks(4, 2, {"loss": ["hf"]})


def test_the_planner_leaves_out_losses_memlab_loss_does_not_support():
    from transformers import GPTNeoXConfig

    cfg = GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        max_position_embeddings=64, vocab_size=256)
    res = P.plan(cfg, "1GiB", batch_size=1, seq_len=16, device="cpu", top=1,
                 allow={"precision": ["fp32"], "checkpointing": ["none"], "optimizer": ["adamw"], "adapter": ["full"],
                        "loss": ["default", "fused"]})
    assert all(r.stack.loss == "default" for r in res.rows)
    assert any("chunked and fused losses left out" in n for n in res.notes)
