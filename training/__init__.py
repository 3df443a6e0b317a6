"""convoy's training engine: pure PyTorch + pydantic (never imports Prefect or DVC)."""
