"""Recipes the executor and storage tests share: four variants on the tiny demo model, among
them a chain of two steps and a twin that differs only in `serve:`."""

FOUR_VARIANTS = """\
name: raytoy
base: demo-tiny
device: cpu
variants:
  - {name: base, steps: []}
  - {name: twice, steps: [{identity: {}}, {identity: {}}]}
  - {name: int8, steps: [{quantize: {method: bnb-int8}}]}
  - {name: int8-kv8, steps: [{quantize: {method: bnb-int8}}], serve: {kv_cache_dtype: int8}}
evals:
  quality: [{task: corpus_ppl, limit: 4}]
  max_length: 32
"""
