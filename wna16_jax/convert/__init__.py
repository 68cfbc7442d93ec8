"""Converters from the loader layout into every backend's kernel layout (one module per backend)."""
