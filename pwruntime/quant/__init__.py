"""Any-precision (AP) quantization of routed-expert weights: codes, bit-planes, checkpoints, the AP store.

Modules: `kmeans` (per-row weighted 1-D k-means seed + incremental upscaling to 8 bits), `pack`
(layout v1 bit-planes and the pure-torch `dequantize` reference), `quantizer` (one block or layer
-> packed planes + LUTs), `ap_checkpoint` (the on-disk AP checkpoint), `store` (APExpertStore, the
ExpertStore serving AP weights at run-time bits; `load_ap_model`), `sensitivity` (Hessian-diagonal
and Fisher k-means weights from calibration text), `build` (`pwruntime quantize`'s driver).
"""
