"""CUDA diagnostics for the estimator and tracker gaps: a one-off probe of the H100 session of
2026-11-23, whose report is ../diag.log (run from the repository root on a GPU machine:
python3 results/h100/probes/gpu_diag.py; it borrows chapter 01's test models)."""
import gc, os, sys
import torch
sys.path.insert(0, "tests/ch01")
from memlab import estimate as E
from memlab.profiler import MemoryTracker

MiB = 2**20
dev = torch.device("cuda")
print("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "| CUBLASLT", os.environ.get("TORCH_CUBLASLT_WORKSPACE_SIZE"))
# 1. cuBLAS workspaces: what matmuls leave allocated, forward (main thread) and backward (autograd thread)
a = torch.randn(1024, 1024, device=dev, requires_grad=True); b = torch.randn(1024, 1024, device=dev)
torch.cuda.synchronize(); m0 = torch.cuda.memory_allocated()
c = a @ b; torch.cuda.synchronize(); m1 = torch.cuda.memory_allocated()
c.sum().backward(); torch.cuda.synchronize(); m2 = torch.cuda.memory_allocated()
lin = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16); y = lin(torch.randn(8, 1024, device=dev, dtype=torch.bfloat16))
torch.cuda.synchronize(); m3 = torch.cuda.memory_allocated()
print(f"fwd matmul leaves {(m1-m0-c.numel()*4)/MiB:.2f} MiB beyond its output; backward adds {(m2-m1-a.numel()*4)/MiB:.2f} MiB beyond a.grad; bf16 addmm adds {(m3-m2-lin.weight.numel()*2-1024*2-y.numel()*2)/MiB:.2f} MiB")
del a, b, c, lin, y; gc.collect(); torch.cuda.empty_cache()

from test_estimate import cuda_gpt, cuda_llama
def unique_bytes(tensors):
    seen, tot = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr()); tot += s.nbytes()
    return tot

for build in (cuda_gpt, cuda_llama):
    for dtype in ("fp32", "bf16"):
        gc.collect(); torch.cuda.empty_cache(); torch.manual_seed(0)
        base = torch.cuda.memory_allocated()
        with torch.device("cuda"):
            model = E.ModelSpec(build.__name__, fn=build).build(dtype, None).train()
        opt = E.optim.make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], device="cuda")
        vocab = E.model.vocab_size(model)
        def step():
            x = torch.randint(0, vocab, (8, 512), device="cuda"); y = torch.randint(0, vocab, (8, 512), device="cuda")
            E.training_step(model, opt, x, y, dtype=dtype)
        step(); torch.cuda.synchronize()
        opt.zero_grad(set_to_none=True); gc.collect(); torch.cuda.synchronize()
        alive = torch.cuda.memory_allocated() - base
        states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda]
        expected = unique_bytes(list(model.parameters()) + list(model.buffers()) + states)
        torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
        step(); torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
        est = E.estimate_training_memory(build, device="cuda", batch_size=8, seq_len=512, dtype=dtype, checkpointing=False)
        print(f"{build.__name__:10s} {dtype}: alive after step {alive/MiB:8.2f} MiB, params+buffers+state {expected/MiB:8.2f} MiB, "
              f"extra {(alive-expected)/MiB:7.2f} MiB | step peak {peak/MiB:8.2f} est {est.peak_bytes/MiB:8.2f} gap {(peak-est.peak_bytes)/MiB:7.2f} MiB "
              f"| est phases {dict((k, round(v/MiB,1)) for k, v in est.tracker.phase_peaks().items())}")
        del model, opt, states; gc.collect()

# 3. tracker vs allocator, as tests/ch01/test_profiler.py does, per optimizer implementation
from test_profiler import gpt, batch, train_step
for impl in ("foreach", "fused", "for-loop"):
    gc.collect(); torch.cuda.empty_cache(); torch.manual_seed(0)
    with torch.device(dev):
        model = gpt(n_layer=4, n_embd=256, block_size=128)
    opt = E.optim.make_optimizer("adamw", model.parameters(), impl=impl, device="cuda", lr=1e-3)
    x, y = (t.to(dev) for t in batch(model, b=8, t=128))
    train_step(model, opt, x, y); torch.cuda.synchronize(); gc.collect()
    torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
    tr = MemoryTracker(model, opt, device="cuda")
    with tr:
        start = tr.current_bytes
        train_step(model, opt, x, y)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - (before - start)
    print(f"tracker {impl:8s}: tracker {tr.peak_bytes/MiB:8.2f} MiB allocator {measured/MiB:8.2f} MiB diff {(measured-tr.peak_bytes)/MiB:6.2f} MiB; phases {dict((k, round(v/MiB,2)) for k, v in tr.phase_peaks().items())}")
