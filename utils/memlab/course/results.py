"""docs/results.md's rows: each a template over figures read from where they are printed, so no row can go stale.

Each :class:`~memlab.course.figures.Row` names the notebook (or stored log) its figures come from and the
line each is read from (:mod:`memlab.course.figures` reads and renders them); rows that no notebook prints
(benches run by hand, the H100 logs, tests) are kept whole in ``results/recorded.json`` with their source.
``tools/render_results.py`` writes docs/results.md's table and README.md's results paragraph and its
account of ``memlab estimate --validate``; ``--check`` fails on any row that differs
(tests/meta/test_results.py). A lecture that changes the words of a line a row reads makes the render stop
naming the notebook, the line and the row: change the row here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from memlab.course import figures
from memlab.course.figures import (CPU, README_BEGIN, README_END, RECORDED, TABLE_BEGIN, TABLE_END, VALIDATE_BEGIN,
                                   VALIDATE_END, VALIDATE_LOG, Counted, Derived, FigureError, Found, Recorded, Row,
                                   num, ratio)

__all__ = ["ROWS", "render_files", "render_table", "stale", "Row", "Found", "Counted", "Derived", "Recorded",
           "FigureError", "ratio", "RECORDED", "VALIDATE_LOG", "TABLE_BEGIN", "TABLE_END", "README_BEGIN",
           "README_END", "VALIDATE_BEGIN", "VALIDATE_END"]


N = {k: f"notebooks/{v}.ipynb" for k, v in {
    "00": "00_where_the_memory_goes", "01": "01_memory_profiler", "02": "02_gradient_checkpointing",
    "03": "03_mixed_precision", "04": "04_cpu_offload_adam", "05": "05_chunked_attention", "06": "06_qlora", "07": "07_fit_a_budget",
    "08": "08_beyond_one_gpu", "09": "09_long_sequences"}.items()}
H100 = "H100"
CKPT, AMP, OFFLOAD = (f"results/h100/bench_{b}.txt" for b in ("checkpoint", "amp", "offload"))


def _same(names: tuple[str, ...], yes: str, no: str) -> Derived:
    return Derived(names, lambda f: yes if len({num(f[n]) for n in names}) == 1 else no.format(**f))


def _max_list_diff(a: str, b: str) -> Derived:
    def fn(f):
        xs, ys = ([num(v) for v in f[k].split(",")] for k in (a, b))
        return f"{max(abs(x - y) for x, y in zip(xs, ys)):.3f}"
    return Derived((a, b), fn)


def _all_true(names: tuple[str, ...], yes: str, no: str) -> Derived:
    return Derived(names, lambda f: yes if all(f[n] == "True" for n in names) else no)

def beside(k: str) -> str:
    """``memlab.profiler.peak_beside_allocator``'s line, its figures named ``{k}t``, ``{k}a``, ``{k}g``, ``{k}u``."""
    return (f"tracker {{{k}t}} B | allocator (cpu) {{{k}a}} B, same run (gap {{{k}g}} B) | allocator without the "
            f"tracker {{{k}u}} B")


def _fits(peak: str, usable: str) -> Derived:
    return Derived((peak, usable, "eager"), lambda f: (
        f"SDPA fits an H100's {f[usable]} GiB usable, eager does not"
        if num(f[peak]) <= num(f[usable]) < num(f["eager"]) else
        f"SDPA {f[peak]} GiB, eager {f['eager']} GiB against an H100's {f[usable]} GiB usable"))



_BLOCK = [Found(N["00"], f"{{s{i}}} {{b{i}}} {{t{i}}} {{f{i}}} {{m{i}}} {{same{i}:text}} {{share{i}}}%".replace(
    f"{{s{i}}} {{b{i}}}", sb)) for i, sb in enumerate(("32 2", "64 4", "128 8"))]
_STAGES = ("data parallel", "ZeRO-1", "ZeRO-2", "FSDP2 (fully_shard)")
_Q = (("ft", "full fine-tune (fp32, AdamW)", "full fine-tune"), ("lo", "LoRA r=8 (fp32 base)", "LoRA r=8"),
      ("ql", "QLoRA r=8 (NF4 base, bf16 compute)", "QLoRA r=8"))
_EST = (("e0", "0: data parallel"), ("e1", "1: ZeRO-1 (memlab)"), ("e2", "2: ZeRO-2 (memlab)"), ("e3", "3: FSDP2"))
_SENT = (("c0", "0: data parallel"), ("c1", "1: ZeRO-1 (memlab)"), ("c2", "2: ZeRO-2 (memlab)"), ("c3", "3: FSDP2"))
_R3 = (("f", "fp32"), ("h", "fp16 + scaler"), ("b", "bf16"), ("m", "fp16 master weights + scaler"))
_LOSS9 = (("d", "transformers' loss"), ("c", "chunked (autograd)"), ("f", "fused"), ("o", "fused + offload + opt. in bwd"))

# the speed rows of `memlab bench speed`, read from its stored output (issue 42.6)
SPEED = "results/cpu/bench_speed.txt"

# `memlab bench estimate`'s stored output: fresh processes, imports included (issue 42.1)
ESTIMATE = "results/cpu/bench_estimate.txt"

ROW_01_ESTIMATE = Row("01", (
    "`memlab estimate` as a fresh process, first run (every trace made), imports included: Llama-2-7B, Llama-2-70B, "
    "7B with all suggestions (`memlab bench estimate`, load {load} on 2 cores)",
    "{c7} / {c70} / {cs} s (CPU {u7} / {u70} / {us} s); the imports alone (a fresh process, nothing traced: "
    "the floor under every first run) {fl} s", "repeat from the trace cache {w7} / {w70} / {ws} s",
    "targets <= {t7} / {t70} / {ts} s"),
    (Found(ESTIMATE, "^7B {c7} {u7} {w7} {wu7} {t7} {n7}"),
     Found(ESTIMATE, "(memlab.bench.estimate.FLOOR_CODE): median {fl} s (cpu {flc})"),
     Found(ESTIMATE, "^70B {c70} {u70} {w70} {wu70} {t70} {n70}"),
     Found(ESTIMATE, "^7B + all suggestions {cs} {us} {ws} {wus} {ts} {ns}"),
     Found(ESTIMATE, "load average over the last minute: {load} on 2 cores")), device=CPU)

PLAN = "results/cpu/bench_plan.txt"  # `memlab bench plan`'s stored output (issue 42.2)

ROW_07_PLAN = Row("07", (
    "`memlab plan llama-3-8b --gpu rtx4090 --seq-len 2048 --batch-size 16` as a fresh process: first run, repeat "
    "(the plan cache), a tiny config's first run (`memlab bench plan`)", "{f} / {r} / {t} s",
    "CPU {fc} / {rc} / {tc} s", "targets <= {ft} / {rt} / {tt} s"),
    (Found(PLAN, "worked, first run in {f} s (target <= {ft} s, process wall time; CPU {fc} s)"),
     Found(PLAN, "worked, repeat in {r} s (target <= {rt} s, process wall time; CPU {rc} s)"),
     Found(PLAN, "tiny, first run in {t} s (target <= {tt} s, process wall time; CPU {tc} s)")), device=CPU)

ROW_01_OVERHEAD = Row("01", (
    "tracker overhead, TinyGPT / tiny Llama step 8x128 with AdamW, 1 thread, medians of interleaved rounds "
    "(`memlab bench speed`, {load})",
    "`MemoryTracker` {tg} / {tl} ms; `timeline=False` {tgn} / {tln} ms", "untracked {tgu} / {tlu} ms",
    "{tgr}x / {tlr}x; `timeline=False` {tgnr}x / {tlnr}x (target <= 1.2x)"),
    (Found(SPEED, "^tinygpt: memlab MemoryTracker {tg} {tgu} {tgr}"),
     Found(SPEED, "^tinygpt: memlab MemoryTracker(timeline=False) {tgn} {tgu2} {tgnr}"),
     Found(SPEED, "^tiny_llama: memlab MemoryTracker {tl} {tlu} {tlr}"),
     Found(SPEED, "^tiny_llama: memlab MemoryTracker(timeline=False) {tln} {tlu2} {tlnr}"),
     Found(SPEED, "machine load: {load:text}")), device=CPU)

ROW_04_THREADS = Row("04", (
    "chapter 04's chunked eager AdamW step ({n} params) at 2 threads vs 1 thread, interleaved (`memlab bench speed`, "
    "{load})", "2 threads {t2} ms", "1 thread {t1} ms", "{r}x the 1-thread speed (target >= 1x)"),
    (Found(SPEED, "^chunked eager AdamW, 1 thread(s) {t1} {t1b} {r1}"),
     Found(SPEED, "^chunked eager AdamW, 2 thread(s) {t2} {t1c} {r}"),
     Found(SPEED, "chunked eager AdamW step ({n} params) at 2 threads"),
     Found(SPEED, "machine load: {load:text}")), device=CPU)

ROW_05_FLASH = Row("05", (
    "causal fwd+bwd 1x4x{{512,1024,2048}}x64 fp32, flash (PyTorch) vs SDPA's flash backend, interleaved "
    "(`memlab bench speed`, {load})", "flash (PyTorch) {f512} / {f1024} / {f2048} ms",
    "SDPA flash backend {s512} / {s1024} / {s2048} ms", "{r512}x / {r1024}x / {r2048}x SDPA speed (target >= 0.5x)"),
    tuple(Found(SPEED, f"^flash attention fwd+bwd, seq {s} {{f{s}}} {{s{s}}} {{r{s}}}") for s in (512, 1024, 2048))
    + (Found(SPEED, "machine load: {load:text}"),), device=CPU)

ROW_06_DEQUANT = Row("06", (
    "NF4 dequantize 1024x1024, fp32 / bf16, {path} path, interleaved (`memlab bench speed`, {load})",
    "{o32} / {o16} ms",
    "bitsandbytes C kernel {b32} / {b16} ms", "{r32}x / {r16}x (target >= 0.5x)"),
    (Found(SPEED, "^NF4 dequantize 1024x1024 float32 {o32} {b32} {r32}"),
     Found(SPEED, "^NF4 dequantize 1024x1024 bfloat16 {o16} {b16} {r16}"),
     Found(SPEED, "NF4 dequantize ran: {path:text}"),
     Found(SPEED, "machine load: {load:text}")), device=CPU)


# the first H200 lease (tools/gpu_session.py, 2026-11-28, torch 2.11.0+cu130): its stored bench logs
H200 = "H200"
H200_ATT, H200_QLORA = (f"results/h200/2026-11-28/bench_{b}.log" for b in ("attention", "qlora"))

ROW_05_TRITON_H200 = Row("05", (
    "causal fwd+bwd 1x16x{{1k,4k,16k}}x64 bf16, Triton FA2 (memlab) vs SDPA's flash backend, medians of 10 "
    "interleaved rounds (`memlab bench attention`, {load})", "Triton {t1} / {t4} / {t16} ms",
    "SDPA flash backend {s1} / {s4} / {s16} ms", "{r1}x / {r4}x / {r16}x SDPA speed (target >= 0.7x): {v}"),
    (Found(H200_ATT, "^triton 1024 {t1} {r1} {tp1} MiB"), Found(H200_ATT, "^triton 4096 {t4} {r4} {tp4} MiB"),
     Found(H200_ATT, "^triton 16,384 {t16} {r16} {tp16} MiB"), Found(H200_ATT, "^sdpa-flash 1024 {s1} {sr1}"),
     Found(H200_ATT, "^sdpa-flash 4096 {s4} {sr4}"), Found(H200_ATT, "^sdpa-flash 16,384 {s16} {sr16}"),
     Found(H200_ATT, "^device: {load:text}")),
    {"v": Derived(("r1", "r4", "r16"), lambda f: ", ".join(
        f"{n} {'met' if num(f[k]) >= 0.7 else 'MISSED'}" for n, k in (("1k", "r1"), ("4k", "r4"), ("16k", "r16"))))},
    device=H200)

ROW_06_NF4_H200 = Row("06", (
    "NF4 quantize / dequantize 4096x4096, fp32 and bf16 (`memlab bench qlora` on CUDA, {dev})",
    "fp32 {q32} / {d32} ms; bf16 {q16} / {d16} ms", "bitsandbytes CUDA kernels fp32 {bq32} / {bd32} ms; bf16 "
    "{bq16} / {bd16} ms", "quantize {rq32}x / {rq16}x ({vq}), dequantize {rd32}x / {rd16}x (target >= 0.5x: {v})"),
    (Found(H200_QLORA, "^quantize {q32} {bq32} {rq32} {gq32} {nq32} {nbq32} {eq32:text}",
           after="4096x4096 float32 matrix"),
     Found(H200_QLORA, "^dequantize {d32} {bd32} {rd32} {gd32} {nd32} {nbd32} {ed32:text}",
           after="4096x4096 float32 matrix"),
     Found(H200_QLORA, "^quantize {q16} {bq16} {rq16} {gq16} {nq16} {nbq16} {eq16:text}",
           after="4096x4096 bfloat16 matrix"),
     Found(H200_QLORA, "^dequantize {d16} {bd16} {rd16} {gd16} {nd16} {nbd16} {ed16:text}",
           after="4096x4096 bfloat16 matrix"),
     Found(H200_QLORA, "^device: {dev:text}")),
    {"vq": Derived(("rq32", "rq16"), lambda f: "met" if min(num(f["rq32"]), num(f["rq16"])) >= 0.5 else "MISSED"),
     "v": Derived(("rd32", "rd16"), lambda f: "met" if min(num(f["rd32"]), num(f["rd16"])) >= 0.5 else
                  "MISSED: a gather per weight, no fused kernel; bit-exact with bitsandbytes in bf16, not in fp32")},
    device=H200)

ROWS: list[Row | Recorded] = [
    Row("00", ("bytes one TinyGPT block saves for backward (s=64, b=4, h=128, fp32, dropout on)",
               "formula: {f1} B", "`saved_tensors_hooks` tape: {t1} B; memlab: {m1} B", "{v}"),
        (_BLOCK[1],), {"v": _same(("t1", "f1", "m1"), "exact", "differ: tape {t1}, formula {f1}, memlab {m1} B")}),
    Row("00", ("lecture 00's on-page `MyBlock` vs memlab's TinyGPT `Block` (same weights); on-page saved-tensor tape "
               "vs `memlab.accounting` at s x b = 32 x 2, 64 x 4, 128 x 8", "outputs, gradients; saved bytes "
               "{t0} / {t1} / {t2} B", "same; formula {f0} / {f1} / {f2} B", "{ident}; {bytes}"),
        (Found(N["00"], "MyBlock output vs memlab's Block exact: {out:text} close: {oc:text} max diff: {od}"),
         Found(N["00"], "gradients (input and all parameters) exact: {gr:text} close: {gc:text} max diff: {gd}"),
         *_BLOCK),
        {"ident": _all_true(("out", "gr"), "outputs and gradients bit-identical", "outputs or gradients differ"),
         "bytes": _all_true(("same0", "same1", "same2"), "bytes exact at the three sizes", "bytes differ")}),
    Row("00", ("Llama-2-7B, s={s}, b={b}, {recipe}, traced on fake tensors with the attention transformers picks "
               "(SDPA) vs eager", "SDPA: {sdpa} GiB peak", "eager: {eager} GiB ({extra} GiB more activations; the "
               "s x s formula says {formula})", "{fit}"),
        (Found(N["00"], "formula, s={s}, b={b}, 16-bit: activations"),
         Found(N["00"], "with the scores kept (eager): +{formula} GiB"),
         Found(N["00"], "traced, attention sdpa: peak {sdpa} GiB in backward"),
         Found(N["00"], "traced, attention eager: peak {eager} GiB in backward"),
         Found(N["00"], "traced, eager over the default: +{extra} GiB of activations"),
         Found(N["00"], "usable: RTX 4090 {u4090} GiB, H100 {uh100} GiB"),
         Found(N["00"], "traced: {recipe:text}, SDPA {sdpa2} GiB")),
        {"fit": _fits("sdpa", "uh100")}),
    Row("00", ("peak of lecture 00's TinyGPT training step against its states + saved activations, by the tracker "
               "and by the allocator (same run)", "tracker: peak {tr}x (states + saved activations); the rise it "
               "measures {xt} B", "allocator: step peak {ap} B = {ar}x; the same rise {xa} B in the same run, {xu} B "
               "without the tracker",
               "the peak is below the sum by both counters (states + saved activations: {sum} B)"),
        (Found(N["00"], "^states + saved activations: {sum} B ="),
         Found(N["00"], "the peak is {tr} x (states + saved activations)\n^" + beside("x")
               + "\n^by the allocator: step peak {ap} B = {ar} x (states + saved activations)"))),
    Recorded("01-memtracker"),
    Recorded("01-allocator-tests"),
    ROW_01_OVERHEAD,
    Recorded("01-bench-70b"),
    ROW_01_ESTIMATE,
    Row("01", ("estimate vs published peaks (`memlab estimate --validate`, `memlab/estimate/validate.py`; every figure "
               "with its source in the log; README lists them)", "{n} comparable figures, {met} meeting their target, "
               "the rest off for a reason the log states; {und} more undecided (each met for a longest batch of at "
               "most {lo} to {hi} tokens); {ne} more listed as not expressible", "published `max_memory_allocated` / reserved / "
               "nvidia-smi figures", "allocated figures: median absolute error {med}% (target {tm}%), worst "
               "{worst}% (target {tw}%)"),
        (Found(VALIDATE_LOG, "allocated figures: median |error| {med}% (target {tm}%), worst {worst}% (target {tw}%)"),
         Found(VALIDATE_LOG, "^{met} of {n} comparable figures meet their target"),
         Found(VALIDATE_LOG, "^{und} undecided ({why:text}): each is at or below its figure for a longest batch of at "
                             "most {lo} to {hi} tokens"),
         Found(VALIDATE_LOG, "^{ne} published figures the estimator cannot express")), device=CPU),
    Recorded("01-h100-cpu-trace"),
    Recorded("01-estimate-real-step"),
    Recorded("01-h100-diag2"),
    Recorded("01-h100-cuda-tests"),
    Row("01", ("lecture 01's on-page tracker (ledger, phases, categories, modules) vs `MemoryTracker`, two TinyGPT "
               "steps", "timeline, breakdowns, phase peaks ({e1} and {e2} events)", "same", "{v}"),
        (Found(N["01"], "^step 1: {e1} events, peak in"), Found(N["01"], "^step 2: {e2} events, peak in"),
         Found(N["01"], "whole timeline (every event: op index, phase, 5 categories) identical: {same:text}")),
        {"v": _all_true(("same",), "identical", "differ")}),
    Row("01", ("tracker peak vs the allocator's own events (`torch.profiler`, `profile_memory=True`), TinyGPT step",
               "tracker: {tpeak} B above the start", "allocator: {apeak} B ({allocs} allocations, {frees} frees)",
               "equal at the end ({aend} / {tend} B); at the peak the allocator holds {extra} B more: {nblk} "
               "wrapped-number scalars of {blk} B made without an op"),
        (Found(N["01"], "allocator: {allocs} allocations, {frees} frees; peak above the start {apeak} B"),
         Found(N["01"], "tracker: peak above the start {tpeak} B"),
         Found(N["01"], "at the end of the window: allocator {aend} B, tracker {tend} B"),
         Found(N["01"], "allocated outside any op: {nblk} x [{blk}] B = {extra} B"))),
    Row("01", ("one steady TinyGPT training step counted three ways (lecture 01): `MemoryTracker`, the allocator's "
               "events in the same run, the allocator in a run without the tracker", "tracker {st} B",
               "allocator same run {sa} B (gap {sg} B); without the tracker {su} B",
               "allocator - tracker: {sg} B in the same run"),
        (Found(N["01"], "^TinyGPT steady step " + beside("s")),)),
    Recorded("02-bench-cpu-peak"),
    Recorded("02-bench-cpu-time"),
    Row("02", ("activation peak, {L}-layer TinyGPT {w} wide, seq {seq}, batch {b}, 4 segments (`memlab bench "
               "checkpoint`)", "{m4} GiB", "torch.utils.checkpoint {t4} GiB; no checkpointing {none} GiB",
               "{m4t} vs torch; {m4r}x vs none; {model} vs the n/k + k model"),
        (Found(CKPT, "memlab bench checkpoint: {L}-layer TinyGPT, seq {seq}, batch {b}, width {w},"),
         Found(CKPT, "^memlab, 4 segments {m4} GiB {m4r} {m4t} {m4ms} {m4tn} {m4tt}"),
         Found(CKPT, "^torch, 4 segments {t4} GiB {t4r} - {t4ms} {t4tn} -"),
         Found(CKPT, "^no checkpointing {none} GiB {nr} - {nms} {ntn} -"),
         Found(CKPT, "ratio {model} activation peak with k=4 segments within")), device=H100),
    Row("02", ("step time, same model, 4 segments / every block (`memlab bench checkpoint`)", "{m4ms} / {mems} ms",
               "torch {t4ms} / {tems} ms; no checkpointing {nms} ms", "{m4tt}x / {mett}x vs torch; {m4tn}x / {metn}x "
               "vs none"),
        (Found(CKPT, "^memlab, 4 segments {m4} GiB {m4r} {m4t} {m4ms} {m4tn} {m4tt}"),
         Found(CKPT, "^memlab, every block {me} MiB {mer} {met} {mems} {metn} {mett}"),
         Found(CKPT, "^torch, 4 segments {t4} GiB {t4r} - {t4ms} {t4tn} -"),
         Found(CKPT, "^torch, every block {te} MiB {ter} - {tems} {tetn} -"),
         Found(CKPT, "^no checkpointing {none} GiB {nr} - {nms} {ntn} -")), device=H100),
    Row("02", ("selective recomputation (matmul outputs kept), one TinyGPT block: lecture's dispatch-mode policy / "
               "memlab / torch `create_selective_checkpoint_contexts`", "{mine} / {lib} / {torch} MiB kept",
               "no checkpoint {none} MiB, full {full} KiB", "{v}; input gradient exact vs none: {g}"),
        (Found(N["02"], "selective: mine {mine} MiB"), Found(N["02"], "selective: memlab {lib} MiB"),
         Found(N["02"], "selective: torch (MUST_SAVE matmuls) {torch} MiB"),
         Found(N["02"], "^no checkpoint {none} MiB"), Found(N["02"], "full: my_checkpoint_amp {full} KiB"),
         Found(N["02"], "selective, mine vs none: input gradient exact: {g:text} close")),
        {"v": _same(("mine", "lib", "torch"), "the three equal", "differ")}),
    Row("02", ("activation offload hooks: lecture's `MyOffload` / `memlab.checkpoint.offload_activations` vs torch "
               "`save_on_cpu`", "{mine} / {lib} MiB moved ({n_mine} / {n_lib} tensors: activations only)",
               "`save_on_cpu` {torch} MiB, {n_torch} tensors (it also copies {views} KiB of weight views)",
               "gradients bit-equal: {g1} / {g2} / {g3}"),
        (Found(N["02"], "^MyOffload {n_mine} tensors {mine} MiB to host gradients bit-equal: {g1:text}"),
         Found(N["02"], "^memlab offload_activations {n_lib} tensors {lib} MiB to host gradients bit-equal: {g2:text}"),
         Found(N["02"], "^torch save_on_cpu {n_torch} tensors {torch} MiB to host gradients bit-equal: {g3:text}"),
         Found(N["02"], "'view of a parameter': '{views} KiB'"))),
    Row("03", ("`DynamicLossScaler` (the page's and memlab's) vs `torch.amp.GradScaler`, {steps} steps with random "
               "inf/NaN gradients", "{nskip} skipped steps ({ninj} with an injected inf/NaN)",
               "same skipped steps: {skip} (page), {skip2} (memlab)",
               "same scale after every update: {scale}; max parameter diff {diff}"),
        (Found(N["03"], "ours vs GradScaler over {steps} steps: same scale after every update: {scale:text}; same "
                        "skipped steps: {skip:text}; max parameter difference ever: {diff}"),
         Found(N["03"], "memlab vs GradScaler over {s2} steps: same scale after every update: {sc2:text}; same "
                        "skipped steps: {skip2:text}; max parameter difference ever: {d2}"),
         Found(N["03"], "skipped {nskip} steps, {ninj} of them with an injected inf/NaN"))),
    Recorded("03-bench-cpu"),
    Row("03", ("TinyGPT step {b} x {s} (`memlab bench amp`): peak, bf16 autocast / fp16 master weights vs fp32",
               "{bf} / {fm} MiB", "fp32 {fp} MiB", "{bfr}x / {fmr}x"),
        (Found(AMP, "memlab bench amp: tinygpt, batch {b} x seq {s}, one AdamW"),
         Found(AMP, "^fp32 {fp} 1 {fpa}", after="memlab bench amp: tinygpt"),
         Found(AMP, "^bf16 {bf} {bfr} {bfa}", after="memlab bench amp: tinygpt"),
         Found(AMP, "^fp16 master weights {fm} {fmr} {fma}", after="memlab bench amp: tinygpt")), device=H100),
    Row("03", ("same bench, step time of `DynamicLossScaler` (from scratch, unfused Python update) vs `GradScaler`",
               "{ds} ms", "{gs} ms", "{r}x slower (tiny model: launch-bound; correctness is bitwise, speed is not "
               "the goal)"),
        (Found(AMP, "^fp16 + DynamicLossScaler {p1} {r1} {a1} {o1} {c1} {ds} {t1} {v1}", after="memlab bench amp: tinygpt"),
         Found(AMP, "^fp16 + GradScaler {p2} {r2} {a2} {o2} {c2} {gs} {t2} {v2}", after="memlab bench amp: tinygpt"),
         Found(AMP, "DynamicLossScaler step time / GradScaler step time = {r}", after="memlab bench amp: tinygpt")),
        device=H100),
    Recorded("03-h100-step-time"),
    Row("03", ("fp16 autocast without loss scaling, TinyGPT, micro-batch loss divided by nanoGPT's 491,520 tokens per "
               "step (lecture 03 section 7)", "no scaling: {z1}% of gradient elements exactly 0 at the first step, "
               "up to {zmax}%; final loss {noscale}", "fp32 {fp32}; fp16 + our scaler {scaled} (<= {szmax}% zeros)",
               "unscaled fp16 visibly fails; scaling fixes it"),
        (Found(N["03"], "^fp32 loss {l0} -> {fp32} (mean of the last 10)"),
         Found(N["03"], "^fp16, no scaling loss {l1} -> {noscale} (mean of the last 10); gradient elements exactly 0: "
                        "{z1}% at the first step, {zmax}% at most"),
         Found(N["03"], "^fp16 + our LossScaler loss {l2} -> {scaled} (mean of the last 10); gradient elements "
                        "exactly 0: {sz1}% at the first step, {szmax}% at most"))),
    Row("03", ("a TinyGPT step's rise above its states, fp32 / fp16 + scaler / bf16 / fp16 master weights + scaler "
               "(lecture 03), by the tracker and the allocator (same run)", "tracker {ft} / {ht} / {bt} / {mt} B",
               "allocator {fa} / {ha} / {ba} / {ma} B; without the tracker {fu} / {hu} / {bu} / {mu} B",
               "peak vs fp32 by the allocator {hpa}x / {bpa}x / {mpa}x; activations vs fp32 {hx}x / {bx}x / {mx}x"),
        tuple(Found(N["03"], f"^{name} " + beside(k)) for k, name in _R3)
        + tuple(Found(N["03"], f"^{name} activations {{{k}share}}% of the peak; vs fp32: activations {{{k}x}}x, peak "
                               f"{{{k}p}}x (allocator: {{{k}pa}}x)") for k, name in _R3[1:])),
    Row("04", ("one optimizer step's rise above its start, `OffloadedAdamW` vs torch AdamW (lecture 04), by the "
               "tracker and the allocator (same run)", "tracker {ot} B; allocator {oa} B (gap {og} B); without the "
               "tracker {ou} B", "torch AdamW: tracker {tt} B; allocator {ta} B (gap {tg} B); without the tracker "
               "{tu} B", "{v}"),
        (Found(N["04"], "^OffloadedAdamW one step, rise above its start: " + beside("o")),
         Found(N["04"], "^torch AdamW one step, rise above its start: " + beside("t"))),
        {"v": _same(("oa", "ta"), "equal by the allocator", "allocator: {oa} vs {ta} B")}),
    Recorded("04-adamw-exact"),
    Recorded("04-cpp-fused"),
    Recorded("04-bench-cpu"),
    ROW_04_THREADS,
    Row("04", ("CPU AdamW step on the GPU machine's {cores} cores (`memlab bench offload`), 10M / 100M params",
               "{m10} / {m100} Gparam/s", "torch fused {f10} / {f100}", "{r10}x ({v10}: thread start-up dominates a "
               "{ms10} ms step) / {r100}x ({v100}); {bw100}% of a 128 MiB `a += b` copy's bandwidth at 100M (the bench "
               "now measures bandwidth at the step's own working set: to re-measure)"),
        (Found(OFFLOAD, "device: CPU x86_64 ({cores} cores,"),
         Found(OFFLOAD, "^memlab flat step [{k1:text}] 10,000,000 {ms10} {m10} {g10} {c10} {s10}"),
         Found(OFFLOAD, "^memlab flat step [{k2:text}] 100,000,000 {ms100} {m100} {g100} {c100} {s100}"),
         Found(OFFLOAD, "^torch AdamW fused 10,000,000 {fms10} {f10} "),
         Found(OFFLOAD, "^torch AdamW fused 100,000,000 {fms100} {f100} "),
         Found(OFFLOAD, "target at 10,000,000 params: fast step {r10}x torch fused (>= 0.9: {v10:text}),"),
         Found(OFFLOAD, "target at 100,000,000 params: fast step {r100}x torch fused (>= 0.9: {v100:text}), {bw100}% "
                        "of copy bandwidth")), device="H100 machine's CPU"),
    Row("04", ("step of a {P}M-parameter TinyGPT, {mb} micro-batches of {b} x {s}, bf16 (`memlab bench offload`)",
               "`OffloadedAdamW`: {os} s, {op} GiB peak", "on-device fused AdamW: {ds} s, {dp} GiB",
               "{ot}x time (target 1.15x: {vt}), {ol}% less device memory (target 45%: {vm}); with offloaded grads "
               "{gt}x and {gl}%. Measured before chapter 04's rewrite (copies once per step, update during backward) "
               "and against fp32 + autocast: to be re-run against the pure-bf16 baseline"),
        (Found(OFFLOAD, "memlab bench offload: TinyGPT {P}M params, {mb} micro-batches of {b} x {s} per step"),
         Found(OFFLOAD, "^on-device fused AdamW {ds} {dr} {dp} {dl}%"),
         Found(OFFLOAD, "^memlab OffloadedAdamW {os} {ot} {op} {ol}%"),
         Found(OFFLOAD, "^memlab OffloadedAdamW + offload grads {gs} {gt} {gp} {gl}%"),
         Found(OFFLOAD, "^target memlab OffloadedAdamW: {ot2}x step time (<= 1.15: {vt:text}), {ol2}% less peak device "
                        "memory (>= 45%: {vm:text})")), device=H100),
    Row("05", ("bytes saved for backward, 4 heads x 32, fp32, seq 512 (lecture 05)",
               "flash: O + logsumexp = b*h*s*(d+1)*4 B ({flash} KiB at 512)",
               "naive b*h*s^2*4 ({naive} MiB at 512); chunked through autograd {chunked} MiB (causal {cc} MiB)",
               "flash linear (formula exact), naive and chunked quadratic"),
        (Found(N["05"], "seq 512: naive saves {naive} MiB flash saves {flash} KiB"),
         Found(N["05"], "seq 512: naive {n2} MiB chunked {chunked} MiB chunked causal {cc} MiB"))),
    Row("05", ("fwd+bwd peak of attention at seq 256, one step counted three ways (lecture 05): `MemoryTracker`, "
               "the allocator's events in the same run, the allocator in a run without the tracker; naive / chunked "
               "through autograd / flash (PyTorch) / SDPA", "tracker {nt} / {ct} / {ft} / {st} B",
               "allocator same run {na} / {ca} / {fa} / {sa} B; without the tracker {nu} / {cu} / {fu} / {su} B",
               "same-run gaps {ng} / {cg} / {fg} / {sg} B (SDPA's per-thread CPU scratch); without the tracker "
               "{nd} / {cd} / {fd} / {sd} B (chunked: under a dispatch mode autograd sums {n_sum} reused gradients out "
               "of place)"),
        tuple(Found(N["05"], f"^{name} seq 256: tracker {{{k}t}} B | allocator (cpu) {{{k}a}} B, same run (gap {{{k}g}} "
                             f"B) | allocator without the tracker {{{k}u}} B ({{{k}d}} B)")
              for k, name in (("n", "naive"), ("c", "chunked (autograd)"), ("f", "flash (PyTorch)"), ("s", "SDPA")))
        + (Found(N["05"], "under a do-nothing mode 0 in place, {n_sum} out of place"),)),
    ROW_05_FLASH,
    ROW_05_TRITON_H200,
    Row("05", ("tiny_llama, 3 AdamW steps and a 4th measured beside the allocator: memlab attention vs sdpa vs "
               "eager (lecture 05)", "losses {ml}; activation peak (tracker) {mp} MiB; 4th step: tracker {mt} B, "
               "allocator same run {ma} B, allocator without the tracker {mu} B", "sdpa {sp} MiB, 4th step "
               "tracker / allocator / untracked {st} / {sa} / {su} B; eager {ep} MiB, {et} / {ea} / {eu} B", "{v}"),
        tuple(Found(N["05"], f"^{name} losses [{{{k}l:text}}] activation peak (tracker) {{{k}p}} MiB\n"
                             f"4th step: tracker {{{k}t}} B | allocator (cpu) {{{k}a}} B, same run (gap {{{k}g}} B) | "
                             f"allocator without the tracker {{{k}u}} B") for k, name in (("m", "memlab"), ("s", "sdpa"),
                                                                                          ("e", "eager"))),
        {"v": Derived(("ml", "sl", "el"), lambda f: "losses equal as printed" if f["ml"] == f["sl"] == f["el"]
                      else f"losses differ: sdpa [{f['sl']}], eager [{f['el']}]")}),
    Recorded("05-triton"),
    Recorded("06-nf4-bitsandbytes"),
    Row("06", ("mean abs error, randn(1024x1024), blocksize 64 (lecture 06)", "NF4 {nf4}", "int4 (k/7) {int4}; FP4 "
               "(e2m1) {fp4}", "{v}"),
        (Found(N["06"], "^NF4 mean |error| {nf4}"), Found(N["06"], "^int4 (k/7) mean |error| {int4}"),
         Found(N["06"], "^FP4 (e2m1) mean |error| {fp4}")),
        {"v": Derived(("nf4", "int4", "fp4"), lambda f: "NF4 lowest" if num(f["nf4"]) < min(num(f["int4"]), num(
            f["fp4"])) else "NF4 not the lowest")}),
    Recorded("06-bench-quantize"),
    ROW_06_DEQUANT,
    ROW_06_NF4_H200,
    Recorded("06-bench-linear4bit"),
    Row("06", ("tiny_llama step, `MemoryTracker` peak: full fine-tune (fp32, AdamW) / LoRA r=8 (fp32 base) / QLoRA r=8 "
               "(NF4 base, bf16 compute)", "{ft_pk} / {lo_pk} / {ql_pk} MiB (stored model {ft_st} / {lo_st} / {ql_st} "
               "MiB; optimizer {ft_o} / {lo_o} / {ql_o} MiB)", "estimate on fake tensors {ft_est} / {lo_est} / "
               "{ql_est} MiB; real step {ft_real} / {lo_real} / {ql_real} MiB", "{v}"),
        tuple(Found(N["06"], f"^{label} trainable {{{k}_tr}} stored {{{k}_st}} MiB peak {{{k}_pk}} MiB (params "
                              f"{{{k}_p}}, optimizer {{{k}_o}}, activations {{{k}_a}})") for k, label, _ in _Q)
        + tuple(Found(N["06"], f"^{short} estimate (fake tensors) {{{k}_est}} MiB | real step {{{k}_real}} MiB "
                               f"|{{{k}_mid:text}}diff {{{k}_diff}} B") for k, _, short in _Q),
        {"v": Derived(("ft_diff", "lo_diff", "ql_diff"), lambda f: "estimate equal to the real step to the byte"
                      if all(num(v) == 0 for v in f.values()) else "estimate off by {ft_diff} / {lo_diff} / "
                      "{ql_diff} B".format(**f))}),
    Row("06", ("tiny Llama QLoRA r=8, one step, rise above the step's start (lecture 06): memlab.quant + "
               "memlab.quant.lora vs transformers BitsAndBytesConfig + bitsandbytes + peft",
               "tracker {mt} B; allocator same run {ma} B; without the tracker {mu} B",
               "production: tracker {pt} B; allocator same run {pa} B; without the tracker {pu} B",
               "{r}x by the allocator"),
        tuple(Found(N["06"], f"^{name} one QLoRA step, rise above its start: tracker {{{k}t}} B | allocator (cpu) "
                             f"{{{k}a}} B, same run (gap {{{k}g}} B) | allocator without the tracker {{{k}u}} B")
              for k, name in (("m", "memlab.quant + memlab.quant.lora"), ("p", "transformers + bitsandbytes + peft")))
        + (Found(N["06"], "^memlab / production by the allocator: {r}"),)),
    Row("06", ("QLoRA of tiny_llama by `measure_training_memory`: memlab's stack (eager attention) against the "
               "production stack with eager or SDPA attention (lecture 06)", "memlab eager / production: {re} with "
               "eager, {rs} with SDPA on both", "production eager {pe} MiB, SDPA {ps} MiB (one step by the "
               "allocator: {pea} / {psa} B)", "memlab eager / production SDPA (the earlier setup): {r1}x: {why}"),
        (Found(N["06"], "^production eager measure_training_memory {pe} MiB | one step: tracker {pet} B | allocator "
                        "(cpu) {pea} B"),
         Found(N["06"], "^production sdpa measure_training_memory {ps} MiB | one step: tracker {pst} B | allocator "
                        "(cpu) {psa} B"),
         Found(N["06"], "^memlab eager / production sdpa (the earlier setup): {r1}; same attention: eager {re}, sdpa "
                        "{rs}")),
        {"why": Derived(("re", "rs"), lambda f: "the attention kernel, not the QLoRA stack" if all(
            abs(num(f[k]) - 1) <= 0.01 for k in ("re", "rs")) else "the stacks differ with the same attention too")}),
    Recorded("06-ground-truth-qlora"),
    Row("06", ("QLoRA fine-tune of tiny_llama, {steps} AdamW steps: memlab.quant + memlab.quant.lora vs transformers "
               "BitsAndBytesConfig(nf4, double quant, bf16) + bitsandbytes + peft", "losses (first {first})",
               "losses", "max diff {diff} (test: < 1e-3 over 10 steps)"),
        (Found(N["06"], "max |loss difference| over {steps} steps: {diff} (first loss {first})"),)),
    Row("06", ("8-bit Adam state and 5 steps at lr 1e-3 vs torch AdamW (lecture 06)",
               "`memlab.quant.Adam8bit`: state {m} B = {mb} B/param", "bitsandbytes Adam8bit {b} B; torch AdamW {t} B "
               "= {tb} B/param", "state bytes {same}; max abs parameter diff vs torch: memlab {d1}, bitsandbytes {d2}"),
        (Found(N["06"], "^memlab.quant.Adam8bit state {m} bytes = {mb} B/param"),
         Found(N["06"], "^bitsandbytes Adam8bit state {b} bytes"),
         Found(N["06"], "^torch AdamW (fp32 state) state {t} bytes = {tb} B/param"),
         Found(N["06"], "max |dp|: memlab vs torch {d1}, bitsandbytes vs torch {d2},")),
        {"same": _same(("m", "b"), "equal", "differ ({m} vs {b})")}),
    Recorded("06-adam8bit-test"),
    Recorded("06-predict-qlora-bytes"),
    Row("07", ("`memlab.plan` of Llama-3-8B on an RTX 4090, seq 2048, batch 16, lecture 07's search space",
               "{traces} stacks traced (the page's own search: {page})", "pick: {pick}: {peak} GiB of {usable} GiB "
               "usable (host {host} GiB)", "the page's search picks the same stack (asserted in the cell)"),
        (Found(N["07"], "^pick: {pick:text}: {peak} GiB estimated of {usable} GiB, needs {host} GiB of host memory"),
         Found(N["07"], "^memlab.plan: {traces} traces; on the page: {page}"))),
    ROW_07_PLAN,
    Row("07", ("tiny Llama under a {budget} MiB budget with `BudgetTrainer` (lecture 07)",
               "{ooms} out-of-memory back-offs, settles on {settled} (the planner's pick: {ppick}); {steps} steps, "
               "loss {l0} -> {l1}", "planned {plan} MiB", "measured {meas} MiB ({r}x planned); every committed step "
               "<= {maxstep} MiB"),
        (Found(N["07"], "measured peak of every committed step: {maxstep} MiB <= budget {budget} MiB"),
         Found(N["07"], "the pick, steps {s0}..{s1}: measured {meas} MiB, planned {plan} MiB (measured / planned = "
                        "{r})"),
         Found(N["07"], "settled on: {settled:text} (the planner's pick: {ppick:text})"),
         Found(N["07"], "^{steps} optimizer steps in {secs} s; loss {l0} -> {l1}"),
         Counted(N["07"], "^step {i}: OOM with {what:text} -> ", "ooms", after="optimizer steps in",
                 until="settled on:"))),
    Recorded("07-kill9"),
    Recorded("07-padding"),
    Row("08", ("tiny Llama, fp32 AdamW, 2 gloo ranks: the page's data parallel, ZeRO-1, ZeRO-2, FSDP2 and memlab's "
               "ZeroOptimizer vs one process accumulating both half-batches (lecture 08)", "losses and weights",
               "one process", "{n_exact} of {n_all} comparisons exact (bit for bit); FSDP2 bf16 mixed precision within "
               "{bf16} of fp32's losses"),
        (Counted(N["08"], "^rank {r}: {what:text} exact: True", "n_exact"),
         Counted(N["08"], "^rank {r}: {what:text} exact: ", "n_all"),
         Found(N["08"], "^0: data parallel 0 {x:text} [{fp32:text}]"),
         Found(N["08"], "^3: FSDP2 bf16 mixed 0 {y:text} [{b16:text}]")),
        {"bf16": _max_list_diff("fp32", "b16")}),
    Row("08", ("per-rank bytes held after a step, stages 0 / 1 / 2 / 3 (params + grads + optimizer; lecture 08)",
               "{t0} / {t1} / {t2} / {t3} MiB", "Rajbhandari et al. 2020's formula: {f0} / {f1} / {f2} / {f3} MiB",
               "as the formula but for AdamW's step counters"),
        tuple(Found(N["08"], f"^stage {i}: parameters {{p{i}}} MiB, gradients {{g{i}:text}}, optimizer {{o{i}}} MiB = "
                             f"{{t{i}}} MiB (the paper's formula: {{f{i}}} MiB") for i in range(4))),
    Row("08", ("peak per rank over one step, the page's data parallel / ZeRO-1 / ZeRO-2 / FSDP2 (lecture 08): "
               "`MemoryTracker` and the CPU allocator's events, same runs", "tracker {t0} / {t1} / {t2} / {t3} MiB",
               "allocator {a0} / {a1} / {a2} / {a3} MiB", "allocator / data parallel: {r1} / {r2} / {r3}; the "
               "one-call collectives allocate: `reduce_scatter_tensor` {rs}x, `all_gather_into_tensor` {ag}x the "
               "flat buffer, a broadcast per slice in place {bc} B"),
        tuple(Found(N["08"], f"rank 0: {name} {{t{i}}} MiB {{a{i}}} MiB {{r{i}}}") for i, name in enumerate(_STAGES))
        + (Found(N["08"], "^rank 1: reduce_scatter_tensor(out, flat) allocates {rsm} MiB = {rs} x the flat buffer"),
           Found(N["08"], "^rank 1: all_gather_into_tensor(flat, slice.clone()) allocates {agm} MiB = {ag} x"),
           Found(N["08"], "^rank 1: a broadcast per slice, in place allocates {bc} B"))),
    Row("08", ("`memlab estimate --world-size 2 --zero-stage N` vs the measured ranks, stages 0-3 (lecture 08)",
               "estimate {e0} / {e1} / {e2} / {e3} MiB", "tracker {e0t} / {e1t} / {e2t} / {e3t} MiB; allocator {e0a} "
               "/ {e1a} / {e2a} / {e3a} MiB", "error vs the tracker {e0e}% / {e1e}% / {e2e}% / {e3e}%; FSDP2's "
               "allocator figure is above by gloo's copies inside its collectives"),
        tuple(Found(N["08"], f"^{label} {{{k}}} MiB {{{k}t}} MiB {{{k}e}}% {{{k}a}} MiB") for k, label in _EST)),
    Row("08", ("bytes sent per step in ring passes over the gradient: data parallel / ZeRO-1 / ZeRO-2 / FSDP2 "
               "(`CommCounter`, lecture 08)", "{c0p} / {c1p} / {c2p} / {c3p}", "paper: 2 / 2 / 2 / 3",
               "sent {c0} / {c1} / {c2} / {c3} MiB against the formula's {c0f} / {c1f} / {c2f} / {c3f} MiB"),
        tuple(Found(N["08"], f"^{label} sent {{{k}}} MiB ({{{k}p}} ring passes) formula {{{k}f}} MiB")
              for k, label in _SENT)),
    Row("09", ("training-step peak above the step's start, small Llama (vocabulary 32,768, 512 tokens; lecture 09): "
               "transformers' loss / chunked through autograd / fused linear cross-entropy / fused + offloaded "
               "checkpoint inputs + optimizer step in backward", "allocator events, a run without the tracker: {da} / "
               "{ca} / {fa} / {oa} MiB", "`MemoryTracker`: {dt} / {ct} / {ft} / {ot} MiB; allocator - tracker in the "
               "same run: {dxg} / {cxg} / {fxg} / {oxg} B", "fused {rf}, fused + both {ro} of transformers' loss "
               "(allocator)"),
        tuple(Found(N["09"], f"^{label} peak above the step's start: allocator {{{k}a}} MiB, tracker {{{k}t}} MiB\n"
                             + beside(k + "x")) for k, label in _LOSS9),
        {"rf": ratio("fa", "da"), "ro": ratio("oa", "da")}),
    Row("09", ("the loss alone, forward + backward, 512 tokens x 32,768 vocabulary (lecture 09)",
               "fused (chunk {C}): {fu} MiB ({fub} bytes per logit); chunked through autograd: {ch} MiB ({chb} bytes "
               "per logit)", "`F.cross_entropy` on materialised logits: {ce} MiB ({ceb} bytes per logit)", "fused {r}"),
        (Found(N["09"], "^F.cross_entropy forward + backward peak {ce} MiB ({ceb} bytes per logit)"),
         Found(N["09"], "^chunked (autograd) forward + backward peak {ch} MiB ({chb} bytes per logit)"),
         Found(N["09"], "^fused, C = {C} forward + backward peak {fu} MiB ({fub} bytes per logit)")),
        {"r": ratio("fu", "ce")}),
    Recorded("09-bench-loss"),
]


def render_table(root: Path, rows: Iterable[Row | Recorded] | None = None) -> str:
    """docs/results.md's table from ``rows`` (default: :data:`ROWS`) read under ``root``."""
    return figures.render_table(root, ROWS if rows is None else rows)


def render_files(root: Path, rows: Iterable[Row | Recorded] | None = None) -> dict[str, str]:
    """{relative path: its new text} for docs/results.md and README.md."""
    return figures.render_files(root, ROWS if rows is None else rows)


def stale(root: Path, rows: Iterable[Row | Recorded] | None = None) -> list[str]:
    """One line per stored row or paragraph that differs from a fresh render (empty: up to date)."""
    return figures.stale(root, ROWS if rows is None else rows)
