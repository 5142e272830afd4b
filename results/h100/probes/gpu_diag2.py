"""Where the tracker and the allocator differ on CUDA: requested vs allocated peaks, and a snapshot.
A one-off probe of the H100 session of 2026-11-23, whose report is ../diag2.log
(python3 results/h100/probes/gpu_diag2.py on a GPU machine; writes $OUT/snap.pickle)."""
import gc, os, pickle, sys
import torch
from memlab.models import TinyGPT, TinyGPTConfig
from memlab.models.corpus import batches, stdlib_corpus
from memlab.profiler import MemoryTracker
MiB = 2**20
corpus = stdlib_corpus(max_bytes=2_000_000)
def train_step(m, o, x, y):
    o.zero_grad(set_to_none=True); _, loss = m(x, y); loss.backward(); o.step()
torch.manual_seed(0)
gcfg = TinyGPTConfig(n_layer=6, n_embd=512, n_head=8, block_size=512)
gm = TinyGPT(gcfg).cuda(); go = torch.optim.AdamW(gm.parameters(), lr=1e-3)
gx, gy = (t.cuda() for t in next(batches(corpus, 8, 512, seed=0)))
train_step(gm, go, gx, gy); torch.cuda.synchronize(); gc.collect()
torch.cuda.reset_peak_memory_stats()
st0 = torch.cuda.memory_stats()
torch.cuda.memory._record_memory_history(max_entries=200_000)
with MemoryTracker(gm, go, device="cuda") as tr:
    train_step(gm, go, gx, gy)
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
st = torch.cuda.memory_stats()
ent = tr.timeline[0].total
for key in ("allocated_bytes", "requested_bytes"):
    base = st0[f"{key}.all.current"]; peak = st[f"{key}.all.peak"]
    print(f"{key}: before {base/MiB:.2f} MiB, peak {peak/MiB:.2f} MiB, step peak - untracked = {(peak - (base - ent))/MiB:.2f} MiB")
print(f"tracker peak {tr.peak_bytes/MiB:.2f} MiB, at enter {ent/MiB:.2f} MiB, phase {tr.peak_phase}")
out = os.environ.get("OUT", ".")
with open(os.path.join(out, "snap.pickle"), "wb") as f:
    pickle.dump(snap, f)
# tracker timeline around its peak vs allocator trace: biggest alloc events lacking python frames
trace = snap["device_traces"][0]
cur = 0; best = (0, 0)
for i, e in enumerate(trace):
    if e["action"] == "alloc": cur += e["size"]
    elif e["action"] == "free_completed": cur -= e["size"]
    if cur > best[0]: best = (cur, i)
print("trace peak (relative) MiB", best[0] / MiB, "at event", best[1], "of", len(trace))
live = {}
for e in trace[: best[1] + 1]:
    if e["action"] == "alloc": live[e["addr"]] = e
    elif e["action"] == "free_completed": live.pop(e["addr"], None)
import collections
agg = collections.Counter()
for e in live.values():
    fr = [f for f in e.get("frames", []) if f["filename"].endswith(".py")]
    key = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in fr[:3]) or "(no python frame) " + " < ".join(f["name"][:60] for f in e.get("frames", [])[:4])
    agg[key] += e["size"]
for k, v in agg.most_common(25):
    print(f"{v/MiB:9.2f} MiB  {k}")
