"""Benchmarks: speed and accuracy measurements run by hand (`python -m benchmarks.NAME`), each
against its baseline in the same run. A recipe's own measurements live in `evals/`; nothing in
`evals/` imports from here."""
