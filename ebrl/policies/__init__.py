"""Policies: every family implements `ebrl.policies.base.Policy` (sample / evaluate)."""
