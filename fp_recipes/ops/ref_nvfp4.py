"""Reference twins (placeholder: being written)."""

__all__: list[str] = []
