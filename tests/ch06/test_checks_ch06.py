"""Chapter 06's checks: a wrapper of the reference earns no points, and the messages name what is wrong.
memlab's own answers pass and the labs' stubs are todo: tests/course/test_course.py."""
from __future__ import annotations

import torch

from memlab import quant
from memlab.course.grading import check


def test_a_wrapper_of_the_reference_passes_but_earns_no_points():
    def nf4_codebook(offset=0.9677083):  # delegates to memlab's answer (issue 25: flagged however wrapped)
        return quant.nf4_codebook(offset)

    r = check("06.nf4_codebook", nf4_codebook, quiet=True)
    assert r.status == "pass" and "calls the reference implementation" in r.message and "no points" in r.message


def test_messages_name_the_problem():
    r = check("06.pack_nibbles", lambda q: quant.pack_nibbles(q, pad=0), quiet=True)
    assert r.status == "fail" and "odd" in r.message
    r = check("06.nf4_codes", lambda w, bs=64: (quant.nf4_codes(w, bs)[0].long(), quant.nf4_codes(w, bs)[1]), quiet=True)
    assert r.status == "fail" and "uint8" in r.message
    r = check("06.predict_qlora_bytes", lambda model, r=8: 1, quiet=True)
    assert r.status == "fail" and "the count is exact" in r.message
    r = check("06.dequantize_nf4", lambda p, a, s, d=torch.float32, b=64: torch.zeros(s, dtype=d), quiet=True)
    assert r.status == "fail" and "differ" in r.message
