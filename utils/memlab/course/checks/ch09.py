"""Checks for chapter 09, "long sequences": the loss's bytes, the fused linear cross-entropy, its Triton
forward kernel, the optimizer step in backward.

Each check draws its cases from fixed seeds over the exercise's input space (token counts, hidden sizes,
vocabularies that no chunk or block divides, chunk sizes from 1 to past the tokens, ignored fractions
and ``ignore_index`` values, fp64 / fp32 / bf16, non-contiguous inputs; frozen and tied parameters,
two optimizers) plus the edges, and judges what the answer achieves (bytes kept, the largest tensor
made, values and gradients, parameters after each step), with hygiene probes: inputs unchanged, a
second call equal to the first, two instances independent.
"""
from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # 09.triton_lce_forward runs the kernel on CPU tensors in Triton's interpreter, chosen when triton is first
    # imported (torch.utils.flop_counter and memlab.profiler import it): choose it before they do
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from memlab.accounting import saved_storages  # noqa: E402
from memlab.course.checks import (  # noqa: E402
    Space, differential, expect, expect_type, flags, ints, layouts, make_tensor, one_of, raise_if_triton_stub, register,
)
from memlab.profiler.allocator import allocator_peak  # noqa: E402


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- 09.predict_loss_bytes
HIDDEN = 16  # the head's hidden size in 09.predict_loss_bytes: small against the tokens, as in a real model's T x V
BYTES_SLACK = 64  # the loss's scalars (its normaliser, the result): far below the smallest omission (8 bytes a token)


def hf_head_and_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a transformers ``*ForCausalLM`` computes after its last norm: the head, then its own loss
    function (upcast to fp32, labels shifted, ``F.cross_entropy`` with ``ignore_index=-100``)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0])


def measure_loss_bytes(tokens: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> tuple[int, int]:
    """``(saved, peak)`` of :func:`hf_head_and_loss` on ``(1, tokens, HIDDEN)`` hidden states and a
    ``(vocab, HIDDEN)`` head in ``dtype``: the bytes autograd keeps beyond the inputs
    (``saved_tensors_hooks``, storages once) and the allocator's peak of forward + backward above them."""
    g = _gen(seed)
    h = torch.randn(1, tokens, HIDDEN, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, HIDDEN, generator=g) / 4).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    saved = sum(saved_storages(hf_head_and_loss, h, w, labels, exclude=[h, w, labels]).values())
    peak, _ = allocator_peak(lambda: hf_head_and_loss(h, w, labels).backward())
    return saved, peak


def predict_loss_bytes_reference(tokens: int, vocab: int, dtype: torch.dtype) -> tuple[int, int]:
    """memlab's answer: the fp32 log-softmax (4 bytes a logit) and the shifted int64 labels are kept; the
    peak is in backward, where the kept log-softmax, its incoming gradient and its output gradient (fp32,
    whatever the logits' dtype) are alive together: 12 bytes a logit."""
    logits = tokens * vocab
    return 4 * logits + 8 * tokens, 12 * logits


LOSS_BYTES_CASES = [(64, 1000, torch.bfloat16), (100, 4099, torch.float32), (33, 2500, torch.float16),
                    (256, 777, torch.bfloat16), (16, 6000, torch.float32)]


@register("09.predict_loss_bytes", reference=lambda: predict_loss_bytes_reference, timeout=120,
          title="predict the loss layer's bytes, then measure them")
def check_predict_loss_bytes(fn):
    """Grade exercise ``09.predict_loss_bytes``: predict the loss layer's bytes, then measure them."""
    def run(case) -> None:
        tokens, vocab, dtype = case.tokens, case.vocab, case.dtype
        where = f"fn({tokens}, {vocab}, {dtype}) ({case})"
        got = fn(tokens, vocab, dtype)
        expect(isinstance(got, tuple) and len(got) == 2 and all(type(x) is int for x in got),
               f"{where}: expected a tuple of two ints (saved_bytes, peak_bytes), got {str(got)[:80]}")
        saved, peak = measure_loss_bytes(tokens, vocab, dtype, seed=case.seed)
        expect(abs(got[0] - saved) <= BYTES_SLACK,
               f"{where}: predicted {got[0]:,} bytes kept for backward, measured {saved:,} (saved_tensors_hooks, "
               f"within {BYTES_SLACK} B): which tensors does log_softmax keep, in which dtype, and what does "
               f"nll_loss keep besides?")
        expect(abs(got[1] - peak) <= BYTES_SLACK,
               f"{where}: predicted a peak of {got[1]:,} bytes, measured {peak:,} (the allocator, forward + "
               f"backward above the inputs, within {BYTES_SLACK} B): which T x V tensors are alive at once, "
               f"and in which phase?")

    edges = [dict(tokens=t, vocab=v, dtype=d) for t, v, d in LOSS_BYTES_CASES]
    # any token count and vocabulary where the T x V tensors are the loss's bytes (tokens >= 4 x the hidden size, 200
    # classes or more: below that the head's own V x H gradient is the peak), odd ones included, the four float
    # dtypes a model's logits come in (transformers upcasts them to fp32 first)
    space = Space(tokens=ints(4 * HIDDEN, 400), vocab=ints(200, 5000),
                  dtype=one_of(torch.bfloat16, torch.float32, torch.float16, torch.float64))
    differential(space, run, edges=edges, examples=8)
    for tokens, vocab in ((131072, 128256), (1, 2), (2**20, 256_000)):
        big = fn(tokens, vocab, torch.bfloat16)
        want = predict_loss_bytes_reference(tokens, vocab, torch.bfloat16)
        expect(isinstance(big, tuple) and len(big) == 2 and big == want,
               f"fn({tokens}, {vocab}, torch.bfloat16): got {str(big)[:80]}, expected {want}: the same formula must "
               f"hold at any size (no measuring inside fn)")


# ----------------------------------------------------------------------------- shared by the loss exercises
class _Largest(TorchDispatchMode):
    """Records the largest tensor (elements) any op produces: a tokens x vocabulary logits matrix shows up here."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), f"{func.__name__} -> {tuple(t.shape)}"
        return out


def _exact_loss(hidden, weight, targets, ignore_index):
    """fp64 loss and gradients of (hidden, weight), all logits at once (the definition)."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    loss = F.cross_entropy(h @ w.T, targets, ignore_index=ignore_index)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _ulp_ratio(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rel: float) -> float:
    """max |got - want| / (one ulp of dtype at want + rel * max |want|)."""
    g, w = got.detach().double(), want.detach().double()
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(torch.finfo(dtype).tiny))))
    return ((g - w).abs() / (ulp + rel * w.abs().max())).nan_to_num(float("inf")).max().item()


# ----------------------------------------------------------------------------- 09.fused_linear_cross_entropy
def fused_reference(hidden, weight, targets, chunk_size, ignore_index=-100):
    """memlab's answer: :func:`memlab.loss.fused_linear_cross_entropy` with the lab's signature."""
    from memlab.loss import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, ignore_index=ignore_index)


FUSED_SPACE = Space(n=ints(1, 160), d=one_of(8, 16, 33), v=ints(2, 700), chunk=one_of(1, 7, 16, 64, 1000),
                    chunk_tail=ints(0, 3), ignore=one_of(-100, -1, "last class"), frac=one_of(0.0, 0.3, 0.9, 1.0),
                    layout=layouts("contiguous", "transposed", "strided", "offset"), dtype=one_of(torch.float64, torch.float32))


def _fused_inputs(case):
    """(hidden, weight, targets, chunk, ignore_index, what) for a drawn case: a chunk that does not divide the
    tokens (``chunk_tail`` past a multiple), ``ignore_index`` -100, -1 or the last class, a fraction of the tokens
    ignored (all but one at 1.0), ``hidden`` in any memory layout."""
    g = _gen(case.seed)
    n, d, v = case.n, case.d, case.v
    chunk = max(1, case.chunk + case.chunk_tail if case.chunk < n else case.chunk)
    ignore_index = v - 1 if case.ignore == "last class" else case.ignore
    hidden = make_tensor((n, d), case.dtype, case.layout, case.seed)
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5).to(case.dtype)
    high = v - 1 if ignore_index == v - 1 else v
    targets = torch.randint(0, max(high, 1), (n,), generator=g)
    targets[torch.rand(n, generator=g) < case.frac] = ignore_index
    targets[int(torch.randint(0, n, (), generator=g))] = int(torch.randint(0, max(high, 1), (), generator=g))  # one counted
    what = (f"{n} tokens, hidden {d} ({case.layout}), vocabulary {v}, chunk_size={chunk}, ignore_index={ignore_index}, "
            f"{int((targets == ignore_index).sum())} ignored, {case.dtype} ({case})")
    return hidden, weight, targets, chunk, ignore_index, what


def _grads(fn, hidden, weight, targets, chunk, ignore_index):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fn(h, w, targets, chunk, ignore_index)
    expect_type("fn(hidden, weight, targets, chunk_size, ignore_index)", loss, torch.Tensor)
    expect(loss.dim() == 0, f"the loss has shape {tuple(loss.shape)}, expected a scalar (the mean over counted tokens)")
    expect(loss.grad_fn is not None, "the loss has no grad_fn: return the output of your autograd.Function (.apply)")
    return loss, *torch.autograd.grad(loss, (h, w))


def _check_against_exact(fn, hidden, weight, targets, chunk, ignore_index, what, tol):
    want = _exact_loss(hidden, weight, targets, ignore_index)
    got = _grads(fn, hidden, weight, targets, chunk, ignore_index)
    for name, g, w in zip(("loss", "d_hidden", "d_weight"), got, want):
        expect(g.dtype == (hidden.dtype if name != "loss" else torch.promote_types(hidden.dtype, torch.float32)),
               f"{name} ({what}): dtype {g.dtype}, expected "
               f"{hidden.dtype if name != 'loss' else torch.promote_types(hidden.dtype, torch.float32)} (the loss "
               f"in fp32 for 16-bit inputs, fp64 for fp64; gradients in the inputs' dtype)")
        diff = (g.detach().double() - w).abs().max().item()
        expect(diff <= tol, f"{name} ({what}): max abs diff {diff:.3g} from the exact (fp64, all logits at once) "
                            f"value, allowed {tol:g}")


@register("09.fused_linear_cross_entropy", reference=lambda: fused_reference, timeout=120,
          title="fused linear + cross-entropy that keeps one number per token")
def check_fused_linear_cross_entropy(fn):
    """Grade exercise ``09.fused_linear_cross_entropy``: fused linear + cross-entropy that keeps one number per token."""
    expect(callable(fn), f"expected a function fn(hidden, weight, targets, chunk_size, ignore_index=-100), got {fn!r:.80}")
    def run(case) -> None:  # values and gradients against fp64 with all logits at once
        hidden, weight, targets, chunk, ii, what = _fused_inputs(case)
        _check_against_exact(fn, hidden, weight, targets, chunk, ii, what, 1e-10 if case.dtype == torch.float64 else 2e-5)

    # the hand-picked cases: a strided hidden with one counted token (the last class), a tail, every chunk size
    edges = [dict(n=40, d=35, v=301, chunk=16, chunk_tail=0, ignore=-100, frac=1.0, layout="strided", dtype=torch.float64),
             dict(n=150, d=33, v=601, chunk=64, chunk_tail=3, ignore="last class", frac=0.3, layout="contiguous",
                  dtype=torch.float32),
             dict(n=1, d=8, v=2, chunk=1, chunk_tail=0, ignore=-1, frac=0.0, layout="contiguous", dtype=torch.float64)]
    differential(FUSED_SPACE, run, edges=edges, examples=16)
    # called twice: the same loss and gradients (no state kept between calls)
    from memlab.course.grading.cases import Case

    hidden, weight, targets, chunk, ii, what = _fused_inputs(Case(**edges[1], seed=20))
    a = _grads(fn, hidden, weight, targets, chunk, ii)
    b = _grads(fn, hidden, weight, targets, chunk, ii)
    expect(all(torch.equal(x, y) for x, y in zip(a, b)), f"{what}: a second call gave another loss or gradients")
    _check_bf16(fn)
    _check_memory(fn)


def _check_bf16(fn):
    """bf16 inputs whose logits are exact in bf16 (small integers): what is left is the loss's own arithmetic."""
    def run(case) -> None:
        n, d, v, chunk = case.n, case.d, case.v, case.chunk
        g = _gen(200 + case.seed)
        hidden = torch.randint(-2, 3, (n, d), generator=g).bfloat16()
        weight = (torch.randint(-2, 3, (v, d), generator=g) / 4).bfloat16()
        targets = torch.randint(0, v, (n,), generator=g)
        targets[torch.rand(n, generator=g) < 0.3] = -100
        targets[0] = v - 1  # one counted token at least, the last class
        what = f"bf16, {n} tokens, hidden {d}, vocabulary {v}, chunk_size={chunk}, logits exact in bf16 ({case})"
        want = _exact_loss(hidden, weight, targets, -100)
        got = _grads(fn, hidden, weight, targets, chunk, -100)
        expect(got[0].dtype == torch.float32, f"loss ({what}): dtype {got[0].dtype}, expected torch.float32")
        err = abs(got[0].double() - want[0]).item()
        expect(err <= 1e-4, f"loss ({what}): off by {err:.3g} from the exact value, allowed 1e-4: compute the "
                            f"logsumexp in fp32 (upcast each chunk's logits before the softmax)")
        for name, x, w in zip(("d_hidden", "d_weight"), got[1:], want[1:]):
            expect(x.dtype == torch.bfloat16, f"{name} ({what}): dtype {x.dtype}, expected torch.bfloat16")
            ratio = _ulp_ratio(x, w, torch.bfloat16, rel=1e-3)
            expect(ratio <= 3.0, f"{name} ({what}): off by {ratio:.1f}x (one bf16 ulp + 1e-3 of the largest "
                                 f"entry), allowed 3x: keep the softmax in fp32 and sum the head's gradient over the "
                                 f"chunks in fp32, rounding to bf16 once")

    edges = [dict(n=n, d=d, v=v, chunk=c, seed=i) for i, (n, d, v, c) in
             enumerate(((256, 16, 1000, 4), (300, 16, 777, 32), (128, 8, 4099, 16)))]
    # long enough for a bf16 running sum to drift (hundreds of tokens), vocabularies no block divides
    differential(Space(n=ints(100, 300), d=one_of(8, 16), v=ints(2, 3000), chunk=one_of(4, 16, 32, 64, 7)), run,
                 edges=edges, examples=4)


def _check_memory(fn):
    """fp32, 256 tokens, 1000 classes, chunks of 16: nothing of the logits' size is made or kept."""
    n, d, v, chunk = 256, 32, 1000, 16
    g = _gen(300)
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (torch.randn(v, d, generator=g) / 6).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::3] = -100
    what = f"fp32, {n} tokens, hidden {d}, vocabulary {v}, chunk_size={chunk}"
    kept = saved_storages(lambda a, b, c: fn(a, b, c, chunk, -100), hidden, weight, targets,
                          exclude=[hidden, weight, targets])
    big = sorted(kept.values(), reverse=True)
    expect(sum(big) <= 2 * n * 8 + 256,
           f"{what}: autograd keeps {sum(big):,} bytes beyond the inputs (largest saved storages: {big[:3]}); "
           f"expected at most two numbers per token ({2 * n * 8:,} bytes): keep the logsumexp (and the target's "
           f"logit if you like), never a chunk's logits, softmax or gradients")
    held = []
    _, end = allocator_peak(lambda: held.append(fn(hidden, weight, targets, chunk, -100)))
    expect(end <= 2 * n * 8 + 1024,
           f"{what}: {end:,} bytes stay allocated after the forward (the allocator, the loss held); expected at "
           f"most two numbers per token: the forward must not compute the gradients ahead (a V x H or N x H "
           f"tensor kept) nor keep any logits (ctx attributes count too)")
    with _Largest() as fwd:
        loss = fn(hidden, weight, targets, chunk, -100)
    with _Largest() as bwd:
        loss.backward()
    limit = max(v * d, chunk * v)
    for phase, big_op in (("forward", fwd), ("backward", bwd)):
        expect(big_op.numel <= limit,
               f"{what}: the {phase} made a tensor of {big_op.numel:,} elements ({big_op.op}); one chunk's logits "
               f"are {chunk * v:,} and the head {v * d:,}: compute {chunk} tokens' logits at a time, in both passes")
    full_peak = []
    for c in (16, 128):
        hidden.grad = weight.grad = None
        peak, _ = allocator_peak(lambda c=c: fn(hidden, weight, targets, c, -100).backward())
        full_peak.append(peak)
    expect(full_peak[1] > full_peak[0],
           f"{what}: the allocator's peak of forward + backward is {full_peak[0]:,} B with chunk_size=16 and "
           f"{full_peak[1]:,} B with 128: it should grow with the chunk (one chunk's logits at a time)")


# ----------------------------------------------------------------------------- 09.triton_lce_forward
BLOCKS = dict(BM=16, BV=64, BD=16)


def triton_lce_forward_reference():
    """memlab's answer: the ``triton.jit`` kernel :func:`memlab.loss.triton_kernels.lce_fwd` (imported here:
    it imports triton)."""
    from memlab.loss.triton_kernels import lce_fwd

    return lce_fwd


def launch_lce_fwd(kernel, hidden, weight, targets, bias=None, softcap=None):
    """Launch ``kernel`` as the lab says: ``(logsumexp, target logit)`` per token, fp32; a target of -1
    matches no class."""
    n, d = hidden.shape
    lse = torch.full((n,), float("nan"), dtype=torch.float32, device=hidden.device)
    tgt = torch.full_like(lse, float("nan"))
    grid = (-(-n // BLOCKS["BM"]),)
    kernel[grid](hidden, weight, weight if bias is None else bias, targets, lse, tgt, n, weight.shape[0], d,
                 hidden.stride(0), weight.stride(0), float(softcap or 1.0), HAS_BIAS=bias is not None,
                 SOFTCAP=softcap is not None, PREC="ieee", **BLOCKS)
    return lse, tgt


def _triton_device():
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if torch.cuda.is_available():
        return torch.device("cuda")
    expect(isinstance(tl.zeros, InterpretedFunction),
           "triton was imported without TRITON_INTERPRET=1 and there is no CUDA device: on a CPU, set "
           "os.environ['TRITON_INTERPRET'] = '1' before the first `import triton` (restart the kernel, run the "
           "lab's first cells in order)")
    return torch.device("cpu")


TRITON_CASES = [  # (tokens, hidden, vocabulary, bias, softcap, ignored every k-th token)
    (50, 40, 300, False, None, 7),   # a vocabulary tail (300 = 4 x 64 + 44), hidden 2.5 blocks
    (16, 16, 64, False, None, 0),    # exact blocks
    (37, 8, 129, True, None, 5),     # hidden under one block, a one-class tail, a bias
    (1, 24, 100, True, 2.5, 0),      # one token, soft-capped
    (33, 32, 200, False, 30.0, 2),   # soft-cap as Gemma 2's, half the tokens ignored
]


@register("09.triton_lce_forward", reference=triton_lce_forward_reference, timeout=300,
          title="the fused loss's forward as a Triton kernel (interpreter on CPU)")
def check_triton_lce_forward(kernel):
    """Grade exercise ``09.triton_lce_forward``: the fused loss's forward as a Triton kernel (interpreter on CPU)."""
    expect(type(kernel).__module__.startswith("triton") and hasattr(kernel, "__getitem__"),
           f"expected a @triton.jit kernel, got {type(kernel).__name__}")
    raise_if_triton_stub(kernel)
    device = _triton_device()

    def run(case) -> None:
        n, d, v, has_bias, cap, every = case.n, case.d, case.v, case.bias, case.softcap, case.every
        g = _gen(400 + case.seed)
        pad = 7 if case.layout == "wider rows" else 0  # rows of a wider buffer: a row stride past the hidden size
        layout = "contiguous" if pad else case.layout
        hidden = make_tensor((n, d + pad), torch.float32, layout, case.seed)[:, :d]
        weight = make_tensor((v, d + pad), torch.float32, layout, case.seed + 1, scale=0.25)[:, :d]
        bias = torch.randn(v, generator=g) if has_bias else None
        targets = torch.randint(0, v, (n,), generator=g)
        targets[-1] = v - 1  # the last class, in the tail block
        if every:
            targets[::every] = -1
        what = (f"{n} tokens, hidden {d}, vocabulary {v}, bias={has_bias}, softcap={cap}, "
                f"{int((targets < 0).sum())} targets -1, rows of hidden and weight {case.layout}, blocks BM=16 BV=64 "
                f"BD=16 ({case})")
        ins = [t.to(device) if t is not None else None for t in (hidden, weight, targets, bias)]
        copies = [t.clone() for t in ins if t is not None]
        try:
            lse, tgt = launch_lce_fwd(kernel, ins[0], ins[1], ins[2], ins[3], cap)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile or run is a failure, said plainly
            raise AssertionError(f"launching the kernel ({what}) raised {type(e).__name__}: {str(e)[:300]}") from None
        z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
        z = z if cap is None else cap * torch.tanh(z / cap)
        want_lse = torch.logsumexp(z, -1)
        want_tgt = torch.where(targets >= 0, z.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
        for name, got, want in (("LSE (natural log)", lse, want_lse), ("TGT (0 for a target of -1)", tgt, want_tgt)):
            got = got.cpu().double()
            expect(not torch.isnan(got).any(), f"{name} ({what}): some tokens were not written (NaN left)")
            diff = (got - want).abs().max().item()
            expect(diff <= 1e-4, f"{name} ({what}): max abs diff {diff:.3g} from fp64, allowed 1e-4")
        expect(all(torch.equal(a, b) for a, b in zip(copies, [t for t in ins if t is not None])),
               f"{what}: the kernel changed its inputs")

    edges = [dict(n=n, d=d, v=v, bias=b, softcap=c, every=e, layout="contiguous", seed=i)
             for i, (n, d, v, b, c, e) in enumerate(TRITON_CASES)]
    # any tokens (one to a few blocks), hidden sizes (under a block, tails), vocabularies (one class to 5 blocks, tails
    # no block divides), bias or not, soft-cap or not, ignored tokens; hidden and weight at an offset or as rows of a
    # wider buffer (the kernel takes one stride per row: layouts whose last dimension is contiguous)
    space = Space(n=ints(1, 40), d=ints(1, 40), v=ints(1, 330), bias=flags(), softcap=one_of(None, 2.5, 30.0),
                  every=one_of(0, 2, 5), layout=layouts("contiguous", "offset", "wider rows"))
    differential(space, run, edges=edges, examples=8)


# ----------------------------------------------------------------------------- 09.optimizer_in_backward
def optimizer_in_backward_reference():
    """memlab's answer: :func:`memlab.offload.optimizer_in_backward`."""
    from memlab.offload import optimizer_in_backward

    return optimizer_in_backward


class _TiedNet(nn.Module):
    """An embedding tied to the output head (or not), a trainable block, a frozen block (or a trainable one), a
    buffer."""

    def __init__(self, vocab: int = 40, dim: int = 12, seed: int = 0, tied: bool = True, frozen: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim)
        if frozen:
            self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight  # tied: one Parameter, used twice
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        x = self.embed(ids)
        x = x + torch.tanh(self.block(x)) + self.scale * self.frozen(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.roll(-1, 1).flatten())


class _Counting:
    """make_optimizer that counts how often it is called and how often each optimizer steps."""

    def __init__(self, kind: str):
        self.kind, self.built, self.steps = kind, [], []

    def __call__(self, params):
        params = list(params)
        if self.kind == "adamw":
            opt = torch.optim.AdamW(params, lr=3e-2, weight_decay=0.1, foreach=False)
        else:
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
        self.built.append(params)
        steps = self.steps
        opt.register_step_post_hook(lambda o, a, k: steps.append(o))
        return opt


def _reference_steps(kind, ids_list, seed, **net):
    model = _TiedNet(seed=seed, **net)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = _Counting(kind)(trainable)
    for ids in ids_list:
        model(ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _after_backward(handle):
    step = getattr(handle, "step", None)  # memlab's handle is an optimizer whose step() marks the step
    if callable(step):
        step()


@register("09.optimizer_in_backward", reference=optimizer_in_backward_reference, timeout=120,
          title="the optimizer step inside backward (post-accumulate-grad hooks)")
def check_optimizer_in_backward(fn):
    """Grade exercise ``09.optimizer_in_backward``: the optimizer step inside backward (post-accumulate-grad hooks)."""
    expect(callable(fn), f"expected a function fn(model_or_params, make_optimizer), got {fn!r:.80}")
    def run(case) -> None:
        kind, seed = case.kind, case.seed
        net = dict(vocab=case.vocab, dim=case.dim, tied=case.tied, frozen=case.frozen)
        g = _gen(500 + seed)
        ids_list = [torch.randint(0, case.vocab, (case.batch, case.length), generator=g) for _ in range(case.steps)]
        model = _TiedNet(seed=seed, **net)
        frozen_before = [p.detach().clone() for p in model.frozen.parameters()]
        opt = _Counting(kind)
        target = {"the model": lambda: model, "a generator of parameters": lambda: (p for p in model.parameters()),
                  "a list of parameters": lambda: list(model.parameters())}[case.given]()
        what = (f"{kind}, {case.given}, {'a tied embedding' if case.tied else 'an untied head'}, "
                f"{'a frozen Linear' if case.frozen else 'every Linear trainable'}, vocabulary {case.vocab}, dim "
                f"{case.dim}, {case.steps} backward(s) ({case})")
        handle = fn(target, opt)
        expect(handle is not None and callable(getattr(handle, "remove", None)),
               f"fn(...) ({what}) returned {type(handle).__name__}; expected a handle with .remove()")
        n_trainable = sum(1 for p in model.parameters() if p.requires_grad)  # parameters() lists a tied one once
        expect(len(opt.built) == n_trainable,
               f"{what}: make_optimizer was called {len(opt.built)} times, expected {n_trainable}: once per distinct "
               f"trainable parameter (a tied weight once, the frozen ones never)")
        expect(all(len(ps) == 1 for ps in opt.built),
               f"{what}: make_optimizer got {[len(ps) for ps in opt.built]} parameters per call; expected one each")
        want = _reference_steps(kind, ids_list, seed, **net)
        for k, ids in enumerate(ids_list):
            opt.steps.clear()
            model(ids).backward()
            _after_backward(handle)
            expect(len(opt.steps) == n_trainable and len({id(o) for o in opt.steps}) == n_trainable,
                   f"{what}, backward {k + 1}: {len(opt.steps)} optimizer steps for {n_trainable} parameters "
                   f"({len({id(o) for o in opt.steps})} distinct optimizers); expected each parameter's optimizer to "
                   f"step once, after its gradient is complete (a tied weight: after both uses)")
            left = [n for n, p in model.named_parameters() if p.grad is not None]
            expect(not left, f"{what}, backward {k + 1}: gradients still held after backward: {left}; free each one "
                             f"after its step (zero_grad(set_to_none=True))")
        for (name, p), w in zip(model.named_parameters(), want.parameters()):
            expect(torch.equal(p.detach(), w.detach()),
                   f"{what}: after {case.steps} step(s) {name} differs from a normal step by up to "
                   f"{(p.detach() - w.detach()).abs().max().item():.3g} (expected the same bits: each parameter's "
                   f"update from its complete gradient)")
        expect(all(torch.equal(a, b) for a, b in zip(frozen_before, model.frozen.parameters())) or not case.frozen,
               f"{what}: a frozen parameter changed")
        handle.remove()
        before = [p.detach().clone() for p in model.parameters()]
        opt.steps.clear()
        model(ids_list[0]).backward()
        expect(not opt.steps and all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
               f"{what}: after handle.remove() a backward still stepped ({len(opt.steps)} steps)")
        expect(model.embed.weight.grad is not None,
               f"{what}: after handle.remove() backward left no gradient: the hooks are still there")

    edges = [dict(kind="adamw", given="the model", tied=True, frozen=True, vocab=40, dim=12, batch=2, length=9,
                  steps=3, seed=0),
             dict(kind="sgd", given="a generator of parameters", tied=True, frozen=True, vocab=40, dim=12, batch=2,
                  length=9, steps=3, seed=1)]
    # AdamW or SGD with momentum, the model or its parameters (a generator, a list), tied or not, a frozen block or
    # none, sizes, batch and length, 1-3 backwards
    space = Space(kind=one_of("adamw", "sgd"), given=one_of("the model", "a generator of parameters", "a list of parameters"),
                  tied=flags(), frozen=flags(), vocab=ints(3, 50), dim=ints(1, 16), batch=ints(1, 3),
                  length=ints(2, 10), steps=ints(1, 3))
    g = _gen(500)
    ids_list = [torch.randint(0, 40, (2, 9), generator=g) for _ in range(3)]
    differential(space, run, edges=edges, examples=10)
    # two models at once, each with its own handle: independent
    m1, m2 = _TiedNet(seed=3), _TiedNet(seed=4)
    o1, o2 = _Counting("adamw"), _Counting("adamw")
    h1, h2 = fn(m1, o1), fn(m2, o2)
    m1(ids_list[0]).backward()
    _after_backward(h1)
    expect(len(o1.steps) == 3 and not o2.steps,
           f"two models, each with its own handle: a backward of the first stepped {len(o1.steps)} of its optimizers "
           f"and {len(o2.steps)} of the second's; expected 3 and 0")
    h1.remove()
    h2.remove()
