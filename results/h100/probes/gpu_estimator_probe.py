"""Measurements the estimator states as facts on CUDA: a one-off probe of the H100 session of
2026-11-23, whose output is ../estimator_probe.json (nvidia-smi's view: ../estimator_probe_smi.txt).
Run from the repository root on a GPU: python3 results/h100/probes/gpu_estimator_probe.py.

1. the CUDA context: what the driver reports as total, and what is gone before PyTorch allocates
   anything (total - free - reserved after init, after the first matmul);
2. the caching allocator's reserved/allocated ratio at the peak of training steps (fragmentation);
3. what CUDA SDPA saves for backward (flash: bf16; efficient: fp32 MHA; fp32 GQA), by
   saved_tensors_hooks, next to the CPU kernel's.
"""
import json
import sys

import torch
import torch.nn.functional as F

out = {}
dev = torch.device("cuda")
props = torch.cuda.get_device_properties(0)
out["name"] = props.name
out["total_memory"] = props.total_memory
torch.zeros(1, device=dev)
free, total = torch.cuda.mem_get_info()
out["after_init"] = dict(free=free, total=total, reserved=torch.cuda.memory_reserved(),
                         context=total - free - torch.cuda.memory_reserved())
a = torch.randn(1024, 1024, device=dev)
(a @ a).sum().item()
free, total = torch.cuda.mem_get_info()
out["after_matmul"] = dict(free=free, total=total, reserved=torch.cuda.memory_reserved(),
                           context=total - free - torch.cuda.memory_reserved())
del a
torch.cuda.empty_cache()


def saved_bytes(fn, *args):
    seen = {}

    def pack(t):
        seen[id(t.untyped_storage())] = (t.untyped_storage().nbytes(), tuple(t.shape), str(t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(*args)
    return y, sorted(seen.values())


b, h, hkv, s, d = 2, 8, 2, 1000, 64
res = {}
for label, dtype, kv in [("bf16_gqa", torch.bfloat16, hkv), ("bf16_mha", torch.bfloat16, h),
                         ("fp32_mha", torch.float32, h), ("fp32_gqa", torch.float32, hkv)]:
    for device in ("cuda", "cpu"):
        q = torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, kv, s, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(b, kv, s, d, device=device, dtype=dtype, requires_grad=True)
        try:
            _, saved = saved_bytes(lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=kv != h), q, k, v)
            res[f"{label}_{device}"] = saved
        except Exception as exc:  # noqa: BLE001
            res[f"{label}_{device}"] = repr(exc)
out["sdpa_saved"] = res

sys.path.insert(0, "utils")
frag = []
try:
    from memlab.models import TinyGPT, TinyGPTConfig, tiny_llama

    builds = [("tinygpt-6x512", lambda: TinyGPT(TinyGPTConfig(n_layer=6, n_embd=512, n_head=8, block_size=512))),
              ("tiny_llama-6x512", lambda: tiny_llama(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                                        num_attention_heads=8, num_key_value_heads=4,
                                                        max_position_embeddings=512, vocab_size=32000))]
    for name, build in builds:
        for amp in (False, True):
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            m = build().cuda()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            V = m.config.vocab_size
            x = torch.randint(0, V, (8, 512), device=dev)
            for i in range(3):
                if i == 2:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                    if isinstance(m, TinyGPT):
                        _, loss = m(x, x)
                    else:
                        loss = m(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
            torch.cuda.synchronize()
            al, rs = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            frag.append(dict(model=name, amp=amp, max_allocated=al, max_reserved=rs, ratio=rs / al))
            del m, opt, x, loss
except Exception as exc:  # noqa: BLE001
    frag.append(repr(exc))
out["fragmentation"] = frag
print(json.dumps(out, indent=1))
