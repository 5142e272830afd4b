"""Chapter 04's checks: right answers written another way pass, and the messages name what is wrong.
memlab's own answers pass and the labs' stubs are todo: tests/course/test_course.py."""
from __future__ import annotations

from memlab import offload
from memlab import offload as O
from memlab.course.grading import check


def test_not_callable_fails_with_a_message():
    r = check("04.adamw_update", 42, quiet=True)
    assert r.status == "fail" and "expected a function" in r.message


def test_chunked_step_with_own_update_passes():
    # the lab's intended answer: the bitwise update applied slice by slice (torch.sqrt, not the kernel's rounding)
    def chunked(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay, chunk):
        for lo in range(0, param.numel(), chunk):
            s = slice(lo, lo + chunk)
            offload.adamw_step_(param[s], grad[s], exp_avg[s], exp_avg_sq[s], step, lr=lr, beta1=beta1, beta2=beta2,
                                eps=eps, weight_decay=weight_decay)

    assert check("04.chunked_step", chunked, quiet=True).status == "pass"


def test_flat_kernel_passes_the_chunked_check():
    def kernel(param, grad, exp_avg, exp_avg_sq, step, *, chunk, **hp):
        offload.adamw_step_flat_(param, grad, exp_avg, exp_avg_sq, step, chunk=chunk, **hp)

    assert check("04.chunked_step", kernel, quiet=True).status == "pass"


def test_memlab_offloaded_adamw_passes_the_optimizer_check():
    """OffloadedAdamW(kernel="exact", offload_gradients=True) is an answer to 04.offload_optimizer too."""
    class Wrapped(O.OffloadedAdamW):
        def __init__(self, params, *, lr, betas, eps, weight_decay):
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, kernel="exact",
                             offload_gradients=True, accumulation_steps=3)

    assert check("04.offload_optimizer", Wrapped, quiet=True).status == "pass"


def test_predict_traffic_counts_what_offloaded_adamw_reports():
    """The check's independent copy counter agrees with OffloadedAdamW's own traffic counter."""
    from memlab.course.checks import ch04

    for name, model in ch04._traffic_models():
        for k, off in ((1, False), (4, True)):
            opt = O.OffloadedAdamW(model.parameters(), offload_gradients=off, accumulation_steps=k)
            for _ in range(k):
                out = model(ch04._input_for(model))
                (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
            opt.step()
            assert ch04._measure_traffic(model, k, off) == (opt.traffic["to_host_bytes"], opt.traffic["to_device_bytes"]), name
