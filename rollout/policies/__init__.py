"""Policies that act in rollout environments: scripted reference solver, transformers, vLLM.

``HFPolicy`` and ``VLLMPolicy`` import torch/transformers/vllm lazily, on first use.
"""

from rollout.policies.base import Action, Message, Policy, PolicyContext
from rollout.policies.hf import HFPolicy
from rollout.policies.scripted import ScriptedPolicy, byte_tokenize
from rollout.policies.vllm import VLLMPolicy

__all__ = ["Action", "Message", "Policy", "PolicyContext", "ScriptedPolicy", "HFPolicy", "VLLMPolicy", "byte_tokenize"]
