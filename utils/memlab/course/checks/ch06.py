"""Checks for chapter 06, the QLoRA stack.

06.nf4_codebook        the 16 NF4 levels from normal quantiles, for any outer quantile ``offset``
06.nf4_codes           blockwise absmax scaling and the nearest level (bitsandbytes' tie rule), unpacked
06.pack_nibbles        two codes per byte, high nibble first, odd counts padded with code 7
06.dequantize_nf4      packed bytes + absmax back to values, bit-exact
06.lora_linear         a LoRA layer equal to peft's: init under a seed, forward, gradients (the input's too),
                       merge / unmerge, alpha / r that is not an integer
06.predict_qlora_bytes predict the bytes of a QLoRA model from the float model; graded exactly (the count is exact)

The references are memlab.quant and memlab.quant.lora, tested bit-exact against bitsandbytes and
equal to peft.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from memlab import quant
from memlab.quant import lora
from memlab.course.checks import (
    Space, differential, expect, expect_type, flags, floats, ints, layouts, lists_of, make_tensor, one_of, register,
)


def _tensor_equal(name: str, got, want) -> None:
    expect_type(name, got, torch.Tensor)
    expect(tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    expect(got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}")
    g, w = got.detach().cpu(), want.detach().cpu()
    if torch.equal(g, w):
        return
    bad = (g != w).nonzero()
    first = tuple(bad[0].tolist()) if bad.numel() else ()
    extra = ""
    if g.is_floating_point():
        extra = f", max abs diff {(g.float() - w.float()).abs().max().item():.3g}"
    raise AssertionError(f"{name}: {len(bad)} of {w.numel()} entries differ (first at {first}: got {g[first].item()!r}, "
                         f"expected {w[first].item()!r}){extra}")


# ----------------------------------------------------------------------------- 06.nf4_codebook
@register("06.nf4_codebook", reference=lambda: quant.nf4_codebook, title="NF4 codebook from normal quantiles")
def check_nf4_codebook(fn) -> None:
    """Grade exercise ``06.nf4_codebook``: NF4 codebook from normal quantiles."""
    expect(callable(fn), f"nf4_codebook: expected a function, got {type(fn).__name__}")
    def run(case) -> None:
        _tensor_equal(f"nf4_codebook(offset={case.offset!r}) (derive the levels from the quantiles; do not paste them)",
                      fn(case.offset), quant.nf4_codebook(case.offset))

    # any outer quantile in (0.5, 1): the codebook is derived, not pasted
    differential(Space(offset=floats(0.51, 0.999)), run, edges=[dict(offset=o) for o in (0.99, 0.95, 0.9)], examples=12)
    _tensor_equal("nf4_codebook()", fn(), quant.nf4_codebook())



# ----------------------------------------------------------------------------- 06.nf4_codes
def _code_cases() -> list[tuple[str, torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(6)
    c = quant.nf4_codebook()
    mids = (c[:-1] + c[1:]) / 2
    ties = torch.cat([mids, torch.tensor([1.0]), -mids.flip(0), torch.zeros(33)])  # absmax 1: scaled == value
    return [
        ("randn 256 float32, blocksize 64", torch.randn(256, generator=gen), 64),
        ("randn (8, 96) float32, blocksize 32", torch.randn(8, 96, generator=gen), 32),
        ("randn 300 (a partial last block), blocksize 64", torch.randn(300, generator=gen), 64),
        ("values exactly on the midpoints between levels (ties)", ties, 64),
        ("an all-zero block between two others", torch.cat([torch.randn(64, generator=gen), torch.zeros(64),
                                                             torch.randn(64, generator=gen) * 5]), 64),
        ("randn (5, 77) bfloat16, blocksize 64", torch.randn(5, 77, generator=gen).bfloat16(), 64),
        ("randn 200 float16 x 100, blocksize 128", (torch.randn(200, generator=gen) * 100).half(), 128),
        ("blocks of very different scales", torch.randn(4, 64, generator=gen) * torch.tensor([[1e-3], [1.0], [10.0], [1e3]]), 64),
    ]


# any shape (partial last blocks, fewer elements than one block), every block size bitsandbytes offers, the three
# float formats, any layout and scale, an all-zero block
CODES_SPACE = Space(shape=one_of((256,), (8, 96), (300,), (5, 77), (3, 1000), (1,), (63,), (2, 3, 40)),
                    blocksize=one_of(64, 32, 128, 256, 4096), dtype=one_of(torch.float32, torch.bfloat16, torch.float16),
                    layout=layouts("contiguous", "transposed", "strided", "offset"), scale=floats(1e-3, 1e3, log=True),
                    zero_block=flags(), values=one_of("normal", "on the midpoints between levels"))


def _on_midpoints(w: torch.Tensor, blocksize: int, seed: int, scale: float) -> None:
    """Fill ``w`` (in place, any layout) with values whose scaled form is exactly a midpoint between two NF4 levels
    (ties), each block holding one +-1 so that its absmax is 1, times a power of two near ``scale``."""
    import math

    c = quant.nf4_codebook()
    mids = (c[:-1] + c[1:]) / 2
    gen = torch.Generator().manual_seed(seed)
    n = w.numel()
    vals = mids[torch.randint(0, len(mids), (n,), generator=gen)] * torch.where(
        torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    vals[::blocksize] = 1.0
    w.copy_((vals * 2.0 ** round(math.log2(scale))).view(w.shape).to(w.dtype))


@register("06.nf4_codes", reference=lambda: quant.nf4_codes, title="blockwise NF4 codes (unpacked)")
def check_nf4_codes(fn) -> None:
    """Grade exercise ``06.nf4_codes``: blockwise NF4 codes (unpacked)."""
    expect(callable(fn), f"nf4_codes: expected a function, got {type(fn).__name__}")
    edges = {name: (w, bs) for name, w, bs in _code_cases()}

    def run(case) -> None:
        if hasattr(case, "edge"):
            name, (w, bs) = case.edge, edges[case.edge]
        else:
            w = make_tensor(case.shape, case.dtype, case.layout, case.seed, scale=case.scale)
            if case.values != "normal":
                _on_midpoints(w, case.blocksize, case.seed, case.scale)
            if case.zero_block and w.numel() > case.blocksize:  # the first block all zeros (its absmax is 0)
                values = w.reshape(-1).clone()
                values[: case.blocksize] = 0
                w.copy_(values.view(w.shape))
            bs, name = case.blocksize, f"drawn ({case})"
        got = fn(w, bs)
        expect(isinstance(got, tuple) and len(got) == 2, f"nf4_codes({name}): return a tuple (codes, absmax), got {type(got).__name__}")
        want_q, want_a = quant.nf4_codes(w, bs)
        _tensor_equal(f"nf4_codes({name}) absmax", got[1], want_a)
        _tensor_equal(f"nf4_codes({name}) codes", got[0], want_q)

    differential(CODES_SPACE, run, edges=[{"edge": k} for k in edges], examples=20)


# ----------------------------------------------------------------------------- 06.pack_nibbles
@register("06.pack_nibbles", reference=lambda: quant.pack_nibbles, title="pack two codes per byte")
def check_pack_nibbles(fn) -> None:
    """Grade exercise ``06.pack_nibbles``: pack two codes per byte."""
    expect(callable(fn), f"pack_nibbles: expected a function, got {type(fn).__name__}")

    def run(case) -> None:
        q = make_tensor((case.n,), torch.uint8, case.layout, case.seed, low=0, high=16)
        odd = " (an odd count: the last byte's low nibble is the pad code 7)" if case.n % 2 else ""
        _tensor_equal(f"pack_nibbles({case.n} codes{odd}, {case.layout} in memory)", fn(q), quant.pack_nibbles(q))

    # any count (odd, one, none), any layout
    differential(Space(n=ints(0, 2049), layout=layouts("contiguous", "strided", "offset")), run, examples=15)
    gen = torch.Generator().manual_seed(7)
    cases = [("codes 0x0, 0xF", torch.tensor([0, 15], dtype=torch.uint8)),
             ("codes 1, 2, 3, 4", torch.tensor([1, 2, 3, 4], dtype=torch.uint8)),
             ("3 codes (odd count)", torch.tensor([15, 0, 9], dtype=torch.uint8)),
             ("1000 random codes", torch.randint(0, 16, (1000,), generator=gen, dtype=torch.uint8)),
             ("333 random codes (odd)", torch.randint(0, 16, (333,), generator=gen, dtype=torch.uint8))]
    for name, q in cases:
        _tensor_equal(f"pack_nibbles({name})", fn(q.clone()), quant.pack_nibbles(q))

    w = torch.randn(7, 13, generator=gen)
    packed = fn(quant.nf4_codes(w)[0])
    _tensor_equal("pack_nibbles(nf4_codes(w)) for w of shape (7, 13), vs bitsandbytes' packed bytes",
                  packed, quant.quantize_nf4(w)[0].reshape(-1))


# ----------------------------------------------------------------------------- 06.dequantize_nf4
@register("06.dequantize_nf4", reference=lambda: quant.dequantize_nf4, title="dequantize NF4, bit-exact")
def check_dequantize_nf4(fn) -> None:
    """Grade exercise ``06.dequantize_nf4``: dequantize NF4, bit-exact."""
    expect(callable(fn), f"dequantize_nf4: expected a function, got {type(fn).__name__}")
    gen = torch.Generator().manual_seed(8)
    def run(case) -> None:
        shape, dtype, bs = case.shape, case.dtype, case.blocksize
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(case.seed)) * case.scale).to(dtype)
        packed, absmax = quant.quantize_nf4(w, bs)
        got = fn(packed, absmax, shape, dtype, bs)
        _tensor_equal(f"dequantize_nf4(shape={shape}, dtype={dtype}, blocksize={bs})", got,
                      quant.dequantize_nf4(packed, absmax, shape, dtype, bs))

    edges = [dict(shape=sh, dtype=dt, blocksize=bs, scale=3.0)
             for sh, dt, bs in [((256,), torch.float32, 64), ((16, 64), torch.bfloat16, 64), ((7, 13), torch.float16, 64),
                                ((3, 100), torch.float32, 32), ((2, 300), torch.bfloat16, 128)]]
    # any shape (an odd count of codes, partial blocks), every block size, the three float formats, any scale
    space = Space(shape=one_of((256,), (7, 13), (1,), (3, 1000), (2, 3, 41), (5,)), dtype=one_of(torch.float32, torch.bfloat16, torch.float16),
                  blocksize=one_of(64, 32, 128, 256, 4096), scale=floats(1e-2, 1e3, log=True))
    differential(space, run, edges=edges, examples=15)


# ----------------------------------------------------------------------------- 06.lora_linear
def _seeded(layer, x, seed: int):
    """``layer(x)`` with the RNG at ``seed``: the same dropout masks for the answer and the reference."""
    torch.manual_seed(seed)
    return layer(x)


@register("06.lora_linear", reference=lambda: lora.LoRALinear, title="LoRA layer equal to peft", timeout=120)
def check_lora_linear(cls) -> None:
    """Grade exercise ``06.lora_linear``: LoRA layer equal to peft."""
    expect(callable(cls), f"LoRALinear: expected a class, got {type(cls).__name__}")
    # r=3, alpha=8 and r=6, alpha=16: alpha / r is not an integer (alpha // r, 2, passes every case where r
    # divides alpha); r=16, alpha=8: a scaling below 1 (alpha // r is 0)
    def run(case) -> None:
        fin, fout, r, alpha, bias = case.fin, case.fout, case.r, case.alpha, case.bias
        torch.manual_seed(0)
        base = nn.Linear(fin, fout, bias=bias)
        where = f"base nn.Linear({fin}, {fout}, bias={bias}), r={r}, alpha={alpha}"
        torch.manual_seed(11)
        got = cls(copy.deepcopy(base), r=r, alpha=alpha)
        torch.manual_seed(11)
        want = lora.LoRALinear(copy.deepcopy(base), r=r, alpha=alpha)
        for attr in ("lora_A", "lora_B", "base"):
            expect(isinstance(getattr(got, attr, None), nn.Module), f"LoRALinear ({where}): needs a submodule .{attr}")
        _tensor_equal(f"LoRALinear ({where}): lora_A.weight after init under torch.manual_seed (peft's order: build "
                      "both nn.Linear, then kaiming_uniform_(A, a=sqrt(5)), zeros_(B))", got.lora_A.weight, want.lora_A.weight)
        _tensor_equal(f"LoRALinear ({where}): lora_B.weight after init", got.lora_B.weight, want.lora_B.weight)
        trainable = sorted(n for n, p in got.named_parameters() if p.requires_grad)
        expect(trainable == ["lora_A.weight", "lora_B.weight"],
               f"LoRALinear ({where}): trainable parameters {trainable}, expected only lora_A.weight and lora_B.weight")
        gen = torch.Generator().manual_seed(r + case.seed)
        with torch.no_grad():
            b = torch.randn(want.lora_B.weight.shape, generator=gen)
            got.lora_B.weight.copy_(b)
            want.lora_B.weight.copy_(b)
        x = torch.randn(*case.batch, fin, generator=gen)
        x_got, x_want = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        torch.manual_seed(case.seed)  # the same dropout masks for both
        y = got(x_got)
        torch.manual_seed(case.seed)
        y_want = want(x_want)
        _tensor_equal(f"LoRALinear ({where}): forward", y, y_want)
        y.square().sum().backward()
        y_want.square().sum().backward()
        expect(x_got.grad is not None, f"LoRALinear ({where}): the input got no gradient: a LoRA layer sits inside a "
               "network, and the layers below it need dL/dx (through the frozen base and through the adapter)")
        _tensor_equal(f"LoRALinear ({where}): the input's gradient dL/dx (both paths: the frozen base's W and the "
                      "adapter's B A; do not run the base under no_grad or feed the adapter a detached x)",
                      x_got.grad, x_want.grad)
        _tensor_equal(f"LoRALinear ({where}): lora_A.weight.grad", got.lora_A.weight.grad, want.lora_A.weight.grad)
        _tensor_equal(f"LoRALinear ({where}): lora_B.weight.grad", got.lora_B.weight.grad, want.lora_B.weight.grad)
        with torch.no_grad():
            got.merge()
            want.merge()
            _tensor_equal(f"LoRALinear ({where}): base.weight after merge()", got.base.weight, want.base.weight)
            _tensor_equal(f"LoRALinear ({where}): forward after merge() (do not add the adapter twice)", _seeded(got, x, case.seed), _seeded(want, x, case.seed))
            expect(got.lora_A.weight.requires_grad and got.lora_B.weight.requires_grad,
                   f"LoRALinear ({where}): merge() left the adapter frozen (requires_grad False)")
            got.unmerge()
            want.unmerge()
            _tensor_equal(f"LoRALinear ({where}): base.weight after unmerge()", got.base.weight, want.base.weight)
            _tensor_equal(f"LoRALinear ({where}): forward after unmerge()", _seeded(got, x, case.seed), _seeded(want, x, case.seed))

    edges = [dict(fin=fin, fout=fout, r=r, alpha=alpha, bias=bias, batch=(5,))
             for (fin, fout, r, alpha, bias) in [(32, 24, 4, 8, True), (16, 40, 8, 32, False), (64, 64, 2, 2, True),
                                                 (32, 24, 3, 8, True), (40, 16, 6, 16, False), (24, 48, 16, 8, True)]]
    differential(LORA_SPACE, run, edges=edges, examples=12)


# the constructor's arguments drawn: any base shape, bias or not, any rank (larger than a side too), alpha an integer
# or not, below or above r (the lab's constructor takes base, r and alpha); inputs with one or two leading dimensions
LORA_SPACE = Space(fin=ints(1, 64), fout=ints(1, 64), r=ints(1, 24), alpha=one_of(8, 16, 1, 2.5, 32, 7),
                   bias=flags(), batch=one_of((5,), (2, 3), (1,)))


# ----------------------------------------------------------------------------- 06.predict_qlora_bytes
def _predict_models() -> list[tuple[str, nn.Module, int]]:
    from memlab.models import tiny_llama

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Linear(256, 64, bias=False))
    mlp.lm_head = nn.Linear(64, 10)
    out = [("an MLP with biases (nn.Sequential + lm_head)", mlp, 8)]
    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(100, 37), nn.ReLU(), nn.Linear(37, 33), nn.Linear(33, 7, bias=False),
                        nn.Linear(7, 1000, bias=False))
    out.append(("odd sizes: Linear(100, 37), Linear(37, 33), Linear(33, 7), Linear(7, 1000) (partial blocks, an odd "
                "count of codes)", odd, 3))
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(512, 1040), nn.Linear(1040, 96, bias=False))
    out.append(("Linear(512, 1040) (8320 blocks: 33 second-level scales) + Linear(1040, 96)", wide, 2))
    torch.manual_seed(0)
    out.append(("tiny_llama()", tiny_llama(), 8))
    torch.manual_seed(0)
    out.append(("tiny_llama(hidden_size=192, intermediate_size=512, num_hidden_layers=3), r=16",
                tiny_llama(hidden_size=192, intermediate_size=512, num_hidden_layers=3), 16))
    torch.manual_seed(0)
    out.append(("tiny_llama(tie_word_embeddings=True), r=4", tiny_llama(tie_word_embeddings=True), 4))
    return out


# MLPs of 1-4 Linear layers of any sizes (partial 64-blocks, odd code counts, more than 256 blocks), biases on all,
# none or every other layer, an lm_head or not, in fp32/bf16/fp16; Llama shapes of any width, MLP size, depth and
# vocabulary, tied embeddings or not; any LoRA rank
QLORA_SPACE = Space(model=one_of("mlp", "llama"), dims=lists_of(ints(1, 1100), 2, 5), bias=one_of("all", "none", "alternate"),
                    lm_head=flags(), dtype=one_of(torch.float32, torch.bfloat16, torch.float16), hidden=one_of(64, 96, 128),
                    intermediate=ints(16, 400), layers=ints(1, 2), vocab=ints(32, 400), tied=flags(), r=ints(1, 16))


def _qlora_case_model(case) -> tuple[str, nn.Module]:
    from memlab.models import tiny_llama

    torch.manual_seed(case.seed)
    if case.model == "llama":
        kw = dict(hidden_size=case.hidden, intermediate_size=case.intermediate, num_hidden_layers=case.layers,
                  vocab_size=case.vocab, tie_word_embeddings=case.tied)
        return f"tiny_llama({', '.join(f'{k}={v}' for k, v in kw.items())})", tiny_llama(**kw)
    dims = case.dims
    bias = [case.bias == "all" or (case.bias == "alternate" and i % 2 == 0) for i in range(len(dims) - 1)]
    model = nn.Sequential(*[nn.Linear(dims[i], dims[i + 1], bias=bias[i]) for i in range(len(dims) - 1)])
    if case.lm_head:
        model.lm_head = nn.Linear(dims[-1], 10)
    model = model.to(case.dtype)
    layers = ", ".join(f"Linear({dims[i]}, {dims[i + 1]}, bias={bias[i]})" for i in range(len(dims) - 1))
    return f"{case.dtype} nn.Sequential({layers}){' + lm_head' if case.lm_head else ''}", model


@register("06.predict_qlora_bytes", reference=lambda: lora.predict_qlora_bytes,
          title="predict QLoRA model bytes, then measure", timeout=180)
def check_predict_qlora_bytes(fn) -> None:
    """Grade exercise ``06.predict_qlora_bytes``: predict QLoRA model bytes, then measure."""
    expect(callable(fn), f"predict_qlora_bytes: expected a function, got {type(fn).__name__}")
    models = _predict_models()

    def run(case) -> None:
        if hasattr(case, "edge"):
            name, model, r = models[case.edge]
        else:
            (name, model), r = _qlora_case_model(case), case.r
        predicted = fn(copy.deepcopy(model), r)
        expect(type(predicted) in (int, float),
               f"predict_qlora_bytes({name}): expected a number of bytes, got {type(predicted).__name__}")
        measured = lora.model_storage_bytes(lora.qlora_model(copy.deepcopy(model), r=r))
        expect(predicted == measured, f"predict_qlora_bytes({name}, r={r}): predicted {predicted:,} bytes, measured "
               f"{measured:,} ({predicted - measured:+,} bytes; the count is exact, so the prediction must be). "
               "Count, per quantized layer: ceil(n/2) code bytes, one uint8 code per 64-block scale (ceil per layer), "
               "one fp32 second-level scale per 256 of those (ceil), one fp32 offset, the bias in bf16, fp32 LoRA A "
               "and B; lm_head / embeddings / norms unquantized, a shared storage once")

    differential(QLORA_SPACE, run, edges=[dict(edge=i) for i in range(len(models))], examples=12)
