"""The offline demo model: corpus, shifted domain, tokenizer, training and cache."""

from catalog.cache import build_info, demo_model_dir, ensure_demo_model
from catalog.train import SPECS

__all__ = ["SPECS", "build_info", "demo_model_dir", "ensure_demo_model"]
