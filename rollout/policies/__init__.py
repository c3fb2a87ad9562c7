"""Policies that act in rollout environments (scripted now; HF / vLLM later)."""

from rollout.policies.base import Action, Message, Policy, PolicyContext
from rollout.policies.scripted import ScriptedPolicy, byte_tokenize

__all__ = ["Action", "Message", "Policy", "PolicyContext", "ScriptedPolicy", "byte_tokenize"]
