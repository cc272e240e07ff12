"""A model runner's decode steps through captured graphs (`graphs.py` has the model).

`GraphedDecodes` owns what the graphs read and write beside the runner's persistent buffers and
KV cache: the attention metadata of each bucket (views of the buffers' first rows), the static
hidden-state output, and the model's decoder and head taken apart, the head run outside the
graph on the step's real rows.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from serve.lora.layers import StepSlots, lora_step_context
from serve.model.attention import AttentionBackend, AttentionMetadata, DecodeGroup, step_context
from serve.model.graphs import (
    DecodeGraphs,
    GraphBackend,
    graph_buckets,
    logits_head,
    why_not_graphable,
)
from serve.model.input_buffers import StepBuffers
from serve.model.kv_cache import KVTensor
from serve.model.step_inputs import StepInputs


class GraphedDecodes:
    def __init__(
        self,
        model: PreTrainedModel,
        buffers: StepBuffers,
        kv_caches: list[tuple[KVTensor, KVTensor]],
        attention: AttentionBackend,
        backend: GraphBackend,
        max_num_seqs: int,
        lora: bool = False,
    ) -> None:
        """Capture every bucket's graph now (raises ValueError naming why it cannot); `lora`:
        the model's linears are LoRA layers, which the graphs run per row through
        `row_slots`, so steps mixing adapters replay too."""
        if why := why_not_graphable(model, attention.static_decodes):
            raise ValueError(f"decode graphs cannot serve this model: {why}; use --enforce-eager")
        self.buffers, self.kv_caches, self.attention = buffers, kv_caches, attention
        self.graphs = DecodeGraphs(backend, graph_buckets(max_num_seqs))
        largest = self.graphs.buckets[-1]
        self.decoder, self.head = model.get_decoder(), logits_head(model)
        width = model.config.get_text_config().hidden_size
        self.hidden = torch.zeros(largest, width, dtype=model.dtype, device=buffers.device)
        """The graphs' static output: final hidden states of the bucket's rows."""
        self.row_slots = (
            torch.zeros(largest, dtype=torch.long, device=buffers.device) if lora else None
        )
        """Each row's adapter slot (0: none), written before each replay."""
        self.meta = {b: self._metadata(b) for b in self.graphs.buckets}
        buffers.pad_decodes(0, largest)  # warm-ups and captures read only the null block
        with torch.inference_mode():
            self.graphs.capture(self._body)

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """What every replay of `bucket`'s graph attends with: views of the buffers' first
        `bucket` rows, all decodes."""
        view = self.buffers.view
        group = DecodeGroup(
            rows=self.buffers.rows[:bucket],
            block_tables=view("block_tables", bucket),
            mask=None,
            seq_lens=view("seq_lens", bucket),
            first_row=0,
        )
        return AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=view("slot_mapping", bucket),
            prefills=[],
            decodes=[group],
            backend=self.attention,
            query_start_loc=view("query_start_loc", bucket + 1),
            seq_lens=view("seq_lens", bucket),
            block_tables=view("block_tables", bucket),
            positions=view("positions", bucket),
            query_lens=view("query_lens", bucket),
            num_decodes=bucket,
            max_query_len=1,
        )

    def _body(self, bucket: int) -> None:
        """What a graph records: the model body over the buffers' first `bucket` rows into the
        static hidden states (device work only: a replay repeats nothing else)."""
        ids = self.buffers.view("input_ids", bucket)[None]
        positions = self.buffers.view("positions", bucket)[None]
        slots = None if self.row_slots is None else StepSlots(row_slots=self.row_slots[:bucket])
        with step_context(self.meta[bucket]), lora_step_context(slots):
            out = self.decoder(input_ids=ids, position_ids=positions, use_cache=False)
        self.hidden[:bucket].copy_(out.last_hidden_state[0])

    def bucket(self, inputs: StepInputs, lora: StepSlots | None) -> int | None:
        """The bucket whose graph runs this step; None (its reason counted): run it eagerly."""
        meta, reason = inputs.meta, None
        if meta.prefills:
            reason = "prefill"
        elif lora is not None and lora.groups and self.row_slots is None:
            reason = "lora"
        bucket = self.graphs.bucket_for(meta.num_decodes)
        if reason is None and bucket is None:
            reason = "batch_size"
        if reason is not None:
            self.graphs.count_eager(reason)
            return None
        return bucket

    def run(self, inputs: StepInputs, bucket: int, lora: StepSlots | None) -> torch.Tensor:
        """Replay `bucket`'s graph over the step's decodes, the rest padding (slot 0), each row
        through its adapter's slot; float32 logits at the step's `logits_rows`."""
        n = inputs.meta.num_decodes
        self.buffers.pad_decodes(n, bucket)
        if self.row_slots is not None:
            self.row_slots[:bucket].zero_()
            for slot, rows in lora.groups if lora is not None else []:
                self.row_slots.index_fill_(0, rows, slot)
        self.graphs.replay(bucket)
        hidden = self.hidden[:n]
        if len(inputs.logits_rows) != n:
            hidden = hidden.index_select(0, inputs.logits_rows)
        return self.head(hidden).float()
