"""Offline calibration (the planner's Omega_off) of a model and its AP checkpoint: `pwruntime calibrate`.

Modules:
  `inputs`   calibration/domain text -> token sequences, the seeded train/held-out split, fingerprints
  `measure`  the measuring expert store: per-sequence, per-block routing-weighted output errors at
             every stored bitwidth, the prompt features phi and routing mass (policies.observe)
  `global_sensitivity`  s[i, b] (paper Eq. 2) from E[x_j^2] and the AP weights
  `heads`    prompt-residual heads per (kind, b -> b') by least squares, confidence and clip bounds
  `search`   the small grid search of buckets, multipliers, floors, depth caps and alpha
  `domains`  per-domain measured damages E_d[i, b] for the simulator's quality model
  `driver`   `calibrate(options)`: everything above, written as a policies.Calibration directory
  `quality`  the perplexity / bytes table at full precision and uniform bitwidths (`pwruntime quality-table`)
"""
from pwruntime.calibrate.driver import CalibrateOptions, calibrate
from pwruntime.calibrate.heads import ResidualHead, fit_residual_head
from pwruntime.calibrate.inputs import model_fingerprint_of

__all__ = ["CalibrateOptions", "ResidualHead", "calibrate", "fit_residual_head", "model_fingerprint_of"]
