"""workbench: derive, serve, evaluate and compare compressed and adapted variants of a causal LM."""

__version__ = "0.1.0"
