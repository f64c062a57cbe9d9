"""Adaptation policies, registered by name (`--method NAME`)."""

from spirit.policies.base import REGISTRY, ModelInfo, Policy, RequestInfo, StaticPolicy, VanillaPolicy

__all__ = ["REGISTRY", "ModelInfo", "Policy", "RequestInfo", "StaticPolicy", "VanillaPolicy"]
