"""A memory timeline you can explore: every tensor storage of a training step as a band in time.

:class:`Timeline` records, next to a :class:`memlab.profiler.MemoryTracker` (which it runs and
exposes as ``.tracker``), one entry per storage: when it was allocated and freed (in dispatched
ops), its bytes, the ATen op that made it, its shape and dtype, the phase (forward, backward,
optimizer) and its category (parameters, gradients, optimizer, activations, other). It works on
CPU, CUDA and fake tensors alike, since it watches the dispatcher, not an allocator.

Two ways to look at it:

* :meth:`Timeline.html` / :meth:`Timeline.show`: a self-contained interactive page (no network,
  no CDN): the allocations stacked in time like PyTorch's memory_viz "Active Memory Timeline",
  coloured by category; hovering a band names the tensor, its category, the op that made it and
  when it lived. ``show()`` displays it inline in JupyterLab.
* :meth:`Timeline.snapshot` / :meth:`Timeline.save_snapshot`: the same allocations in the
  pickle format of ``torch.cuda.memory._snapshot()`` (``segments`` and ``device_traces`` with
  ``alloc`` / ``free_requested`` / ``free_completed`` events), which https://pytorch.org/memory_viz
  opens (drag the file onto the page). The frames of each event carry the category, the op, the
  shape and the phase, so memory_viz's hover shows them too. (torch's own
  ``torch.cuda._memory_viz.trace_plot`` writes an HTML page that loads memory_viz's JavaScript
  from a CDN, so it does not work offline; :meth:`Timeline.html` does.)

Usage::

    from memlab.profiler.timeline import Timeline
    with Timeline(model, optimizer) as tl:
        loss = model(x, y)[1]; loss.backward(); optimizer.step(); optimizer.zero_grad()
    tl.show()                                 # in a notebook
    tl.save_html("timeline.html"); tl.save_snapshot("step.pickle")   # for pytorch.org/memory_viz

The peak of the bands equals ``tl.tracker.peak_bytes``, to the byte: the
timeline is the tracker's count, tensor by tensor. Each band's category is the
one the tracker gives its storage at that moment (the same phase rules); when the
tracker relabels a storage (a gradient autograd hands over, a buffer an optimizer
step keeps outside its state), its band ends and one of the new category carries on.
"""
from __future__ import annotations

import html as _html
import json
import math
import pickle
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.core.validation import check_positive_int
from memlab.profiler.allocator import CUDA_BLOCK_BYTES
from memlab.profiler.storage import CATEGORIES, FRESH_ALIAS_OPS
from memlab.profiler.tracker import MemoryTracker

__all__ = ["Allocation", "Timeline", "COLORS"]

#: one colour per category (matplotlib's tab10)
COLORS = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer": "#2ca02c",
          "activations": "#d62728", "other": "#7f7f7f"}


@dataclass
class Allocation:
    """One tensor storage's life: ``start`` and ``end`` are op counts (``end`` is None while alive)."""

    start: int
    end: int | None
    nbytes: int
    category: str
    op: str
    shape: tuple
    dtype: str
    phase: str
    device: str

    @property
    def label(self) -> str:
        """The op that made the storage, its shape and dtype, in one line."""
        return f"{self.op} -> {list(self.shape)} {self.dtype}"


def _outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)] if len(out) < 64 else [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError, TypeError):
        return None


class _Recorder(TorchDispatchMode):
    def __init__(self, tl: "Timeline") -> None:
        super().__init__()
        self.tl = tl

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tl = self.tl
        tl._ops += 1  # this op's index: its outputs start here; what it frees is gone from here on
        tl._inside = True
        try:
            out = func(*args, **(kwargs or {}))
            phase = tl._phase()
            cat = {"forward": "activations", "backward": "activations", "optimizer": "optimizer"}.get(phase, "other")
            name = str(getattr(func, "overloadpacket", func)).replace("aten.", "")
            old = None  # the inputs' storages: an output aliasing one the timeline never met was born
            for t in _outputs(out):  # before recording (a view of an old batch): no band, as the tracker
                if func not in FRESH_ALIAS_OPS:
                    if old is None:
                        old = {_key(a) for a in _outputs([*args, *(kwargs or {}).values()])}
                    k = _key(t)
                    if k in old and k not in tl._live:
                        continue
                tl._add(t, cat, name, phase)
        finally:
            tl._inside = False
        return out


class Timeline:
    """Record every tensor storage of the steps run inside ``with Timeline(model, optimizer):``.

    Args:
        model, optimizer: as for :class:`memlab.profiler.MemoryTracker`: their parameters,
            buffers, gradients and optimizer state are the ``parameters`` / ``gradients`` /
            ``optimizer`` categories and are on the timeline from the start (op 0).
        device: count only storages on this device type (``"cuda"``, ``"cpu"``, ``"meta"``).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                 device: str | torch.device | None = None) -> None:
        self.tracker = MemoryTracker(model, optimizer, device=device)  # validates the arguments
        self.model, self.optimizer = model, optimizer
        self._device_type = None if device is None else torch.device(device).type
        self.allocations: list[Allocation] = []
        self._live: dict[int, tuple[Allocation, weakref.ref]] = {}
        self._ops = 0
        self._inside = False
        self._last = "other"  # the phase the tracker is in (its rules, see _phase)
        self._in_opt = 0
        self._opt_before: set[int] = set()
        self._continues: dict[int, int] = {}  # an allocation's index -> the index of the band it carries on
        self._index: dict[int, int] = {}  # id(an allocation) -> its index in allocations
        self._handles: list[Any] = []
        self._recorder = _Recorder(self)

    # ------------------------------------------------------------------ recording
    def _phase(self) -> str:
        # MemoryTracker's rules, so that a band's category is the one the tracker gives its storage: optimizer step >
        # autograd engine running > the engine has just finished (other) > the last phase started; the forward
        # phase starts with the model's own forward and lasts until the backward (the loss made outside the model
        # is an activation, as the tracker counts it)
        if self._in_opt:
            p = "optimizer"
        elif torch._C._current_graph_task_id() != -1:
            p = "backward"
        elif self._last == "backward":
            p = "other"
        else:
            p = self._last
        self._last = p
        return p

    def _add(self, t: torch.Tensor, category: str, op: str, phase: str, relabel: bool = False) -> None:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):
            return
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None:
            if relabel and entry[0].category != category:
                self._relabel(key, category)
            return
        if self._device_type is not None and t.device.type != self._device_type:
            return
        n = st.nbytes()
        if t.device.type == "cuda":
            n = math.ceil(n / CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
        # made by an op: from that op; found by a hook between ops (a tensor made without an op, such
        # as the optimizer's step counters): from the next op, when the tracker first counts it too
        start = 0 if op == "(before)" else (self._ops if self._inside else self._ops + 1)
        a = Allocation(start, None, n, category, op, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                       phase, str(t.device))
        self._index[id(a)] = len(self.allocations)
        self.allocations.append(a)

        def free(ref: weakref.ref, key: int = key) -> None:
            e = self._live.get(key)
            if e is not None and e[1] is ref:
                del self._live[key]
                # freed inside op k: gone at k; freed between ops k and k+1: alive at k (as the tracker,
                # which reads its totals after each op)
                e[0].end = self._ops if self._inside else self._ops + 1

        self._live[key] = (a, weakref.ref(st, free))

    def _state(self, op: str) -> None:
        if self.model is not None:
            for p in self.model.parameters():
                self._add(p, "parameters", op, "other", relabel=True)
            for b in self.model.buffers():
                self._add(b, "parameters", op, "other", relabel=True)
        params = list(self.model.parameters()) if self.model is not None else []
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                params += [p for p in g["params"] if isinstance(p, torch.Tensor)]
        for p in params:
            self._add(p, "parameters", op, "other", relabel=True)
            if p.grad is not None:
                self._add(p.grad, "gradients", op, "backward", relabel=True)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in (state.values() if isinstance(state, dict) else []):
                    for t in _outputs(v):
                        self._add(t, "optimizer", op, "optimizer", relabel=True)

    def _not_state(self) -> None:
        """As the tracker does after a step: what the step allocated and still holds outside ``optimizer.state`` is
        not optimizer state but ``other``, from the next op on (its band ends; a band of ``other`` carries on)."""
        state = set()
        for st in self.optimizer.state.values():
            for v in (st.values() if isinstance(st, dict) else []):
                state.update(k for k in (_key(t) for t in _outputs(v)) if k is not None)
        for key, (a, _) in list(self._live.items()):
            if a.category == "optimizer" and key not in state and key not in self._opt_before:
                self._relabel(key, "other")

    def _relabel(self, key: int, category: str) -> None:
        """A live storage changes category between two ops (a gradient autograd just handed over, state the
        optimizer made): as the tracker counts it, the new category from the next op on. Its band ends there and a
        band of the new category carries on (at the same address in :meth:`snapshot`)."""
        a, ref = self._live[key]
        at = self._ops if self._inside else self._ops + 1
        if a.start >= at:  # made since the last op: it has the new category from its start
            a.category = category
            return
        a.end = at
        b = Allocation(at, None, a.nbytes, category, a.op, a.shape, a.dtype, a.phase, a.device)
        self._continues[len(self.allocations)] = self._index[id(a)]
        self._index[id(b)] = len(self.allocations)
        self.allocations.append(b)
        self._live[key] = (b, ref)

    def _install(self) -> None:
        if self.model is not None:
            def pre(mod, args):  # the model's own forward starts outside the engine: the forward phase
                if not self._in_opt and torch._C._current_graph_task_id() == -1:
                    self._last = "forward"

            self._handles.append(self.model.register_forward_pre_hook(pre))
            for p in self.model.parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda p: p.grad is not None and self._add(p.grad, "gradients", "grad", "backward", relabel=True)))
        if self.optimizer is not None:
            def opt_pre(opt, args, kwargs):
                self._in_opt += 1
                self._opt_before = {k for k, e in self._live.items() if e[0].category == "optimizer"}

            def opt_post(opt, args, kwargs):
                self._in_opt = max(0, self._in_opt - 1)
                self._state("optimizer state")
                self._not_state()
                if not self._in_opt:
                    self._last = "other"

            self._handles += [self.optimizer.register_step_pre_hook(opt_pre),
                              self.optimizer.register_step_post_hook(opt_post)]

    def __enter__(self) -> "Timeline":
        self._state("(before)")
        self._install()
        self.tracker.__enter__()
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recorder.__exit__(*exc)
        self.tracker.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._state("(after)")

    # ------------------------------------------------------------------ reading
    @property
    def ops(self) -> int:
        """How many ops were dispatched inside the block."""
        return self._ops

    def live_bytes(self) -> list[int]:
        """The sum of the bands at each time: bytes alive after each op ``0 .. ops``."""
        delta = [0] * (self._ops + 2)
        for a in self.allocations:
            delta[a.start] += a.nbytes
            if a.end is not None:
                delta[a.end] -= a.nbytes
        out, run = [], 0
        for d in delta[: self._ops + 1]:
            run += d
            out.append(run)
        return out

    @property
    def peak_bytes(self) -> int:
        """The highest point of :meth:`live_bytes` (the tracker's ``peak_bytes``)."""
        return max(self.live_bytes(), default=0)

    # ------------------------------------------------------------------ memory_viz
    def snapshot(self) -> dict:
        """The allocations as ``torch.cuda.memory._snapshot()`` lays them out (one trace per device
        type here: index 0), for https://pytorch.org/memory_viz. Addresses are made up (the
        dispatcher sees no allocator); each block's frames name its category, op, shape and phase.
        A dict with ``segments`` and ``device_traces``."""
        addr, next_addr = {}, 0
        for i, a in enumerate(self.allocations):
            if i in self._continues:  # a relabelled storage: the same block
                addr[i] = addr[self._continues[i]]
                continue
            addr[i] = next_addr
            next_addr += max(CUDA_BLOCK_BYTES, math.ceil(a.nbytes / CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES)

        def frames(a: Allocation) -> list[dict]:
            return [{"filename": f"category: {a.category}", "line": a.start, "name": f"{a.label} ({a.phase})"},
                    {"filename": f"device: {a.device}", "line": 0, "name": "memlab.profiler.timeline"}]

        events = []
        for i, a in enumerate(self.allocations):
            if a.start > 0 or a.op not in ("(before)",):
                events.append((a.start, 1, i, "alloc"))
            if a.end is not None:
                events.append((a.end, 0, i, "free"))
        events.sort()
        trace = []
        for t, _, i, kind in events:
            a = self.allocations[i]
            base = {"addr": addr[i], "size": a.nbytes, "stream": 0, "frames": frames(a), "time_us": t}
            if kind == "alloc":
                trace.append({"action": "alloc", **base})
            else:
                trace.append({"action": "free_requested", **base})
                trace.append({"action": "free_completed", **base})
        blocks, cursor = [], 0
        alive = [(i, a) for i, a in enumerate(self.allocations) if a.end is None]
        for i, a in sorted(alive, key=lambda ia: addr[ia[0]]):  # a relabelled storage keeps its earlier address
            if addr[i] > cursor:
                blocks.append({"size": addr[i] - cursor, "state": "inactive"})
            blocks.append({"size": a.nbytes, "requested_size": a.nbytes, "state": "active_allocated",
                           "frames": frames(a)})
            cursor = addr[i] + a.nbytes
        if next_addr > cursor:
            blocks.append({"size": next_addr - cursor, "state": "inactive"})
        segment = {"device": 0, "address": 0, "total_size": next_addr, "allocated_size": sum(
            b["size"] for b in blocks if b["state"] == "active_allocated"), "active_size": 0,
            "requested_size": 0, "stream": 0, "segment_type": "large", "blocks": blocks}
        return {"segments": [segment], "device_traces": [trace]}

    def save_snapshot(self, path: str | Path) -> Path:
        """Pickle :meth:`snapshot` to ``path`` (open it at https://pytorch.org/memory_viz); returns
        ``path`` as a Path."""
        path = Path(path)
        path.write_bytes(pickle.dumps(self.snapshot()))
        return path

    # ------------------------------------------------------------------ interactive HTML
    def _data(self, max_bands: int) -> dict:
        # x runs from op 0 to a short "end" slot past the last op (2% of the width): what the step frees
        # after its last op (zero_grad) is gone there
        end = self._ops + 1 + max(1, self._ops // 50)
        allocs = sorted(range(len(self.allocations)), key=lambda i: -self.allocations[i].nbytes)
        keep = set(allocs[:max_bands])
        rows = []
        for i, a in enumerate(self.allocations):
            if i in keep:
                rows.append([a.start, end if a.end is None else a.end, a.nbytes,
                             CATEGORIES.index(a.category), a.label, a.phase])
        small = len(self.allocations) - len(rows)
        return {"ops": end, "rows": rows, "categories": list(CATEGORIES),
                "colors": [COLORS[c] for c in CATEGORIES], "peak": self.peak_bytes, "hidden": small}

    def html(self, title: str = "memory timeline", max_bands: int = 4000, width: int = 900,
             height: int = 360, full_page: bool = False) -> str:
        """A self-contained interactive view (inline JavaScript, no network): one band per storage,
        stacked in allocation order, coloured by category; hover names the tensor. The
        ``max_bands`` largest storages are drawn (the rest are counted in the caption).

        Args:
            max_bands: how many storages to draw, the largest first (an int >= 1).
            width, height: the plot's size in pixels.
            full_page: a whole HTML document rather than a fragment.

        Raises:
            ValueError: a bad ``max_bands``.
        """
        check_positive_int("max_bands", max_bands)
        uid = f"mlt{id(self):x}{self._ops:x}"
        data = json.dumps(self._data(max_bands), separators=(",", ":"))
        body = _TEMPLATE.replace("$UID", uid).replace("$DATA", data).replace("$TITLE", _html.escape(title)) \
            .replace("$W", str(int(width))).replace("$H", str(int(height)))
        if full_page:
            return f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_html.escape(title)}</title></head>" \
                   f"<body style='margin:12px;background:#fff'>{body}</body></html>"
        return body

    def save_html(self, path: str | Path, **kwargs: Any) -> Path:
        """Write :meth:`html` (``kwargs`` are passed to it) as a whole page to ``path``; returns
        ``path`` as a Path."""
        path = Path(path)
        path.write_text(self.html(full_page=True, **kwargs), encoding="utf-8")
        return path

    def show(self, **kwargs: Any):
        """Display :meth:`html` (``kwargs`` are passed to it) inline (JupyterLab runs the inline
        script of outputs it trusts: those of cells run in this session)."""
        from IPython.display import HTML, display

        display(HTML(self.html(**kwargs)))

    def _repr_html_(self) -> str:
        return self.html()


_TEMPLATE = r"""<div id="$UID" style="font:12px sans-serif;position:relative;width:$Wpx">
<div style="font-weight:bold;margin-bottom:4px">$TITLE</div>
<canvas width="$W" height="$H" style="border:1px solid #ccc;cursor:crosshair"></canvas>
<div class="legend" style="margin-top:4px"></div>
<div class="tip" style="position:absolute;display:none;pointer-events:none;background:#fffbe6;border:1px solid #999;padding:4px 6px;white-space:nowrap;box-shadow:1px 1px 3px #aaa"></div>
<script>
(function(){
const D=$DATA, root=document.getElementById("$UID"), cv=root.querySelector("canvas"), ctx=cv.getContext("2d");
const tip=root.querySelector(".tip"), W=cv.width, H=cv.height, L=70, B=22, T=18;
function fmt(n){const u=["B","KiB","MiB","GiB","TiB"];let i=0;while(Math.abs(n)>=1024&&i<4){n/=1024;i++;}return (i?n.toFixed(2):n)+" "+u[i];}
const ev=[];D.rows.forEach((r,i)=>{ev.push([r[0],1,i]);ev.push([r[1],0,i]);});
ev.sort((a,b)=>a[0]-b[0]||a[1]-b[1]);
let top=0;{let live=0;ev.forEach(e=>{live+=e[1]?D.rows[e[2]][2]:-D.rows[e[2]][2];if(live>top)top=live;});}
top=Math.max(top,1);const sx=x=>L+(W-L-4)*x/Math.max(D.ops,1), sy=y=>H-B-(H-B-T)*y/top;
// replay: the live allocations in allocation order, their offsets recomputed at each change
// a segment is emitted only when a band's offset changes (a band below it was freed) or it ends
const segs=[],cur=new Map();let order=[];
let k=0;while(k<ev.length){const t=ev[k][0];while(k<ev.length&&ev[k][0]===t){const e=ev[k];const i=e[2];
  if(e[1])order.push(i);else{order=order.filter(j=>j!==i);const c=cur.get(i);if(c){if(t>c[0])segs.push([c[0],t,c[1],D.rows[i][2],i]);cur.delete(i);}}k++;}
 let y=0;order.forEach(i=>{const c=cur.get(i);if(!c)cur.set(i,[t,y]);else if(c[1]!==y){if(t>c[0])segs.push([c[0],t,c[1],D.rows[i][2],i]);cur.set(i,[t,y]);}y+=D.rows[i][2];});}
cur.forEach((c,i)=>{if(D.ops>c[0])segs.push([c[0],D.ops,c[1],D.rows[i][2],i]);});
ctx.fillStyle="#fff";ctx.fillRect(0,0,W,H);
segs.forEach(s=>{const r=D.rows[s[4]];ctx.fillStyle=D.colors[r[3]];const x0=sx(s[0]),x1=sx(s[1]),y0=sy(s[2]+s[3]),y1=sy(s[2]);
 ctx.fillRect(x0,y0,Math.max(x1-x0,0.5),Math.max(y1-y0,0.5));});
ctx.strokeStyle="#333";ctx.beginPath();ctx.moveTo(L,T);ctx.lineTo(L,H-B);ctx.lineTo(W-4,H-B);ctx.stroke();
ctx.fillStyle="#333";ctx.textAlign="right";for(let i=0;i<=4;i++){const v=top*i/4;ctx.fillText(fmt(v),L-4,sy(v)+4);}
ctx.textAlign="center";ctx.fillText("dispatched op",(L+W)/2,H-6);ctx.fillText("0",L,H-B+12);ctx.fillText("end",W-10,H-B+12);
ctx.setLineDash([4,3]);ctx.beginPath();ctx.moveTo(L,sy(D.peak));ctx.lineTo(W-4,sy(D.peak));ctx.stroke();ctx.setLineDash([]);
ctx.textAlign="left";ctx.fillText("peak "+fmt(D.peak),L+4,sy(D.peak)-3);
root.querySelector(".legend").innerHTML=D.categories.map((c,i)=>'<span style="display:inline-block;width:10px;height:10px;background:'+D.colors[i]+';margin:0 4px 0 10px"></span>'+c).join("")+
 (D.hidden?' <span style="color:#666;margin-left:10px">('+D.hidden+' smallest storages not drawn)</span>':"");
function esc(s){return String(s).replace(/[&<>]/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;"})[c]);}
cv.addEventListener("mousemove",ev2=>{const b=cv.getBoundingClientRect(),x=ev2.clientX-b.left,y=ev2.clientY-b.top;
 const t=(x-L)/(W-L-4)*D.ops,v=(H-B-y)/(H-B-T)*top;let hit=null;
 for(const s of segs){if(t>=s[0]&&t<s[1]&&v>=s[2]&&v<s[2]+s[3]){hit=s;break;}}
 if(!hit){tip.style.display="none";return;}const r=D.rows[hit[4]];
 tip.innerHTML="<b>"+esc(r[4])+"</b><br>"+fmt(r[2])+" &middot; <span style='color:"+D.colors[r[3]]+"'>"+D.categories[r[3]]+"</span> &middot; made in "+r[5]+
  "<br>alive from op "+r[0]+" to "+(r[1]>=D.ops?"the end":"op "+r[1])+" (freed there)";
 tip.style.display="block";tip.style.left=Math.min(x+12,W-260)+"px";tip.style.top=(y+12)+"px";});
cv.addEventListener("mouseleave",()=>{tip.style.display="none";});
// a page opened with #hover=peak shows the tooltip of the largest band alive at the peak (screenshots, tests)
if(/hover=peak/.test(location.hash||"")){let tp=0,live=0,best=-1;ev.forEach(e=>{live+=e[1]?D.rows[e[2]][2]:-D.rows[e[2]][2];if(live>best){best=live;tp=e[0];}});
 let h=null;segs.forEach(s=>{if(tp>=s[0]&&tp<s[1]&&(!h||s[3]>h[3]))h=s;});
 if(h){const b=cv.getBoundingClientRect();cv.dispatchEvent(new MouseEvent("mousemove",{clientX:b.left+sx(tp+0.5),clientY:b.top+sy(h[2]+h[3]/2)}));}}
})();
</script></div>"""
