"""GPU kernels for AP expert weights and paged KV: the glue between cuda/*.cu and the runtime.

Modules: `device_table` (the device-side weight page table the kernels read), `moe` (fused AP MoE
decode, two launches per layer, CUDA-graph capturable; single-block AP linear), `dequant` (AP ->
fp16/bf16 for prefill GEMMs), `ap_gemm` (a grouped GEMM that decodes AP blocks into its tiles: prefill at
3-4 bits), `attention` (paged-attention decode, GQA), `reference` (the pure-torch reference of every
kernel, used on CPU and in tests), `compile` (CuPy RawModule cache and launches on torch's stream),
`bench` (`pwruntime bench kernels`). CuPy is imported lazily, only on the CUDA path.
"""
from pwruntime.kernels.attention import paged_attention_decode
from pwruntime.kernels.dequant import dequantize_blocks
from pwruntime.kernels.device_table import DeviceWeightTable, ResidentBlock
from pwruntime.kernels.moe import MoEShape, MoEWorkspace, ap_linear, fused_moe

__all__ = ["DeviceWeightTable", "ResidentBlock", "MoEShape", "MoEWorkspace", "fused_moe", "ap_linear",
           "dequantize_blocks", "paged_attention_decode"]
