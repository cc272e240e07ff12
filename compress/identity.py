"""The identity step: the variant is its input, mirrored into its own directory.

A recipe's `steps: []` means exactly this step, so the base variant is an artifact like any other
(its own dir and manifest) without a second copy of the weights where hard links are possible.
"""

from __future__ import annotations

from compress.artifact import Artifact, link_or_copy_tree
from compress.registry import Step, StepContext, register


@register
class Identity(Step):
    name = "identity"
    accepts = ("model", "adapter")

    def apply(self, artifact: Artifact, ctx: StepContext) -> Artifact:
        link_or_copy_tree(artifact.path, ctx.out_dir)
        return Artifact(
            ctx.out_dir, artifact.kind, base=artifact.base, quantization=artifact.quantization
        )
