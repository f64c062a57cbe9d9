"""Adaptation policies, registered by name (`--method NAME`).

Importing this package registers every built-in policy in `REGISTRY`.
"""

from spirit.policies.base import REGISTRY, ModelInfo, Policy, RequestInfo, StaticPolicy, VanillaPolicy
from spirit.policies.dv import DraftVerifyPolicy
from spirit.policies.fixed import FixedPolicy
from spirit.policies.sp2ec import Sp2ecPolicy
from spirit.policies.spirit import SpiritPolicy
from spirit.policies.swift import SwiftPolicy

__all__ = ["REGISTRY", "ModelInfo", "Policy", "RequestInfo", "StaticPolicy", "VanillaPolicy", "SpiritPolicy",
           "Sp2ecPolicy", "SwiftPolicy", "DraftVerifyPolicy", "FixedPolicy"]
