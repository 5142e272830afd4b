"""Mixed precision from scratch (chapter 03): number formats, dynamic loss scaling, fp32 master weights.

Micikevicius et al. 2018, "Mixed Precision Training". One module per idea:

* :mod:`memlab.amp.formats`: how fp32, fp16 and bf16 split their bits (``torch.finfo``);
* :mod:`memlab.amp.casting`: what a cast flushes to zero or inf, which ops autocast runs in 16 bits;
* :mod:`memlab.amp.loss_scaling`: :class:`DynamicLossScaler`, bitwise in lockstep with
  ``torch.amp.GradScaler``, and its two kernels;
* :mod:`memlab.amp.master`: :class:`MasterWeights`, a 16-bit model stepped through an fp32 copy;
* :mod:`memlab.amp.recipes`: the bytes of one AdamW update per recipe, predicted and measured.

"fp16" / "bf16" mean mixed precision with fp32 master weights here, as everywhere in memlab
(:mod:`memlab.core.vocab`).
"""
from memlab.amp.casting import (OpRecord, overflow_fraction, record_op_dtypes, round_trip, summarize_op_dtypes,
                                underflow_fraction)
from memlab.amp.formats import FORMATS, as_float_dtype, bit_fields, format_info, format_table, format_table_str
from memlab.amp.loss_scaling import DynamicLossScaler, OptState, unscale_grads_, update_scale_
from memlab.amp.master import MasterWeights, copy_grads_to_master, copy_master_to_model, master_step
from memlab.amp.recipes import UPDATE_RECIPES, measure_update_peak, update_peak_bytes, update_recipe_dtype

__all__ = [
    "FORMATS",
    "as_float_dtype",
    "format_info",
    "format_table",
    "format_table_str",
    "bit_fields",
    "round_trip",
    "underflow_fraction",
    "overflow_fraction",
    "OpRecord",
    "record_op_dtypes",
    "summarize_op_dtypes",
    "unscale_grads_",
    "update_scale_",
    "OptState",
    "DynamicLossScaler",
    "MasterWeights",
    "master_step",
    "copy_grads_to_master",
    "copy_master_to_model",
    "UPDATE_RECIPES",
    "update_recipe_dtype",
    "update_peak_bytes",
    "measure_update_peak",
]
