"""Planners: PagedWeight (paper Algorithm 1) and the baselines it is compared against (numpy only)."""
from policies.planners.base import PolicyError, apply_plan_now, weight_bytes
from policies.planners.baselines import (Fp16Params, Fp16Policy, StaticMixedParams, StaticMixedPolicy,
                                         UniformParams, UniformPolicy)
from policies.planners.dpllm import DpLlmParams, DpLlmPolicy
from policies.planners.expert_lru import ExpertLruParams, ExpertLruPolicy
from policies.planners.pagedweight import PagedWeightParams, PagedWeightPolicy
from policies.planners.allocation import sensitivity_optimal_bits

__all__ = [
    "PolicyError", "apply_plan_now", "weight_bytes", "sensitivity_optimal_bits",
    "Fp16Params", "Fp16Policy", "UniformParams", "UniformPolicy", "StaticMixedParams", "StaticMixedPolicy",
    "DpLlmParams", "DpLlmPolicy", "ExpertLruParams", "ExpertLruPolicy",
    "PagedWeightParams", "PagedWeightPolicy",
]
