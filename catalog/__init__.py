"""The models and data the project ships or builds: the offline demo models (corpus, shifted
domain, tokenizer, training, cache), GGUF bases converted once, and the named data sets."""

from catalog.cache import build_info, demo_model_dir, ensure_demo_model
from catalog.names import named_model_dir
from catalog.train import SPECS

__all__ = ["SPECS", "build_info", "demo_model_dir", "ensure_demo_model", "named_model_dir"]
