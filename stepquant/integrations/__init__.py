"""Integrations of compressed recurrent states into model frameworks.

- hf_cache.py: a transformers cache (CompressedStateCache) whose GDN / KDA layers hold encoded states
  (import it from stepquant.integrations.hf_cache; it needs transformers>=5.23,<5.24).
"""
