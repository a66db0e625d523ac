"""Integrations with other frameworks (model conversion, Megatron-core)."""
