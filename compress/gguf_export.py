"""Exporting a variant as one GGUF file, the format llama.cpp and Ollama load.

Model: the variant's weights in float (a packed variant's codes dequantized; an int4-wo variant's
bfloat16 weights, which torchao quantizes only when loaded) are written under llama.cpp's tensor
names (`gguf.TensorNameMap`): the weights the variant quantized in a GGML type of the same bits
(4 -> Q4_1, the asymmetric min/scale grid of torchao's and RTN's 4-bit; 8 -> Q8_0), the weights it
kept in float in its float dtype, norms in F32, as llama.cpp's converter does; `--gguf-type`
puts every 2-D weight in one type (F32, F16, BF16, Q8_0, Q4_0, Q4_1: the types the `gguf`
package quantizes; the K-quants through llama.cpp's quantizer, `compress.gguf_kquants`).
Llama's q/k projections are permuted to GGML's interleaved rotary layout (the inverse of what
transformers' GGUF loader undoes). The hyperparameters, the tokenizer (byte-level BPE as `gpt2`:
tokens, token types, merges, special ids, and the name of its pre-tokenizer's regex:
`compress.gguf_pretokenizer`) and the chat template travel in the file's metadata.
The round trip: transformers' GGUF loader (which the workbench uses to import GGUF bases) gives
back exactly the GGML type's dequantization of each weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.gguf_kquants import K_QUANTS
from compress.gguf_pretokenizer import UnknownPreTokenizer, pre_tokenizer_name

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""transformers model types this exporter writes (llama.cpp arch names are the same)."""
GGUF_FILE = "model.gguf"


class GgufExportError(ValueError):
    """A variant that cannot be written as GGUF; the message names why and the fix."""


def float_type(state: dict[str, torch.Tensor]) -> str:
    """The GGML type of the variant's own float dtype."""
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    return {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32")


def write_gguf(
    source: Path,
    state: dict[str, torch.Tensor],
    types: dict[str, str],
    rest: str,
    out_file: Path,
) -> dict[str, Any]:
    """Write `state` (the variant's float weights, by transformers name) with `source`'s config
    and tokenizer as `out_file`: a 2-D weight in `types[name]`, any other 2-D one in `rest`, 1-D
    tensors in F32; returns the tensor count per GGML type."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(source).get_text_config()
    if config.model_type not in ARCHITECTURES:
        raise GgufExportError(
            f"{source}: a {config.model_type} model cannot be written as GGUF by this exporter "
            f"(it writes {', '.join(ARCHITECTURES)}); export it as hf and convert that with "
            "llama.cpp's convert_hf_to_gguf.py"
        )
    for wanted in {rest, *types.values()}:
        if wanted not in GGUF_TYPES:
            raise GgufExportError(
                f"--gguf-type: found {wanted!r}; allowed: {', '.join(GGUF_TYPES)}, and with "
                f"llama.cpp's quantizer {', '.join(K_QUANTS)}"
            )
    tok = AutoTokenizer.from_pretrained(source)
    backend = json.loads(tok.backend_tokenizer.to_str())
    pre = _pre_tokenizer(source, backend)
    arch = gguf.MODEL_ARCH[config.model_type.upper()]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(out_file), config.model_type)
    _hyperparameters(writer, config, "/".join(sorted({rest, *types.values()})))
    _tokenizer(writer, tok, backend, pre)
    counts: dict[str, int] = {}
    for hf_name, tensor in state.items():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GgufExportError(f"{source}: no GGUF name for tensor {hf_name}")
        data = permuted(hf_name, tensor.float(), config)
        add_tensor(gguf, writer, name, data, types.get(hf_name, rest), counts)
    finish(writer)
    return counts


def finish(writer: Any) -> None:
    """Write the header, the metadata and the tensors added to `writer`, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tensor(
    gguf: Any, writer: Any, name: str, data: torch.Tensor, wanted: str, counts: dict[str, int]
) -> None:
    """`data` (float32) into `writer` in the GGML type `wanted` (`tensor_type`'s fallbacks
    applied): F32 / F16 as arrays, other types quantized by the `gguf` package; `counts` counts
    the tensors written per type."""
    qtype = tensor_type(gguf, wanted, data)
    counts[qtype.name] = counts.get(qtype.name, 0) + 1
    types = gguf.GGMLQuantizationType
    array = data.contiguous().numpy()
    if qtype in (types.F32, types.F16):
        writer.add_tensor(name, array.astype(np.float16 if qtype == types.F16 else np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def tensor_type(gguf: Any, wanted: str, data: torch.Tensor) -> Any:
    """Norms and other 1-D tensors stay F32; a weight whose rows do not split into the type's
    blocks falls back to F16 (as llama.cpp's converter does)."""
    types = gguf.GGMLQuantizationType
    if data.dim() == 1:
        return types.F32
    qtype = types[wanted.upper()]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return qtype if data.shape[-1] % block == 0 else types.F16


def permuted(name: str, weight: torch.Tensor, config: Any) -> torch.Tensor:
    """Llama's q/k rows reordered from rotate-half pairs to GGML's interleaved pairs."""
    if config.model_type != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return weight
    heads = config.num_attention_heads
    if name.endswith("k_proj.weight"):
        heads = config.num_key_value_heads
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hyperparameters(writer: Any, config: Any, gguf_type: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10_000.0
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_name(f"workbench export ({gguf_type})")


def _pre_tokenizer(source: Path, backend: dict[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name for a BPE tokenizer; GgufExportError for any other
    tokenizer, or a pre-tokenizer llama.cpp has no name for (checked before anything is
    written)."""
    kind = backend["model"].get("type")
    if kind != "BPE":
        raise GgufExportError(
            f"the tokenizer is {kind}, not byte-level BPE; this exporter writes "
            "BPE tokenizers only: export as hf and convert with llama.cpp's converter"
        )
    try:
        return pre_tokenizer_name(backend)
    except UnknownPreTokenizer as e:
        raise GgufExportError(f"{source}: {e}") from None


def _tokenizer(writer: Any, tok: Any, backend: dict[str, Any], pre: str) -> None:
    """A byte-level BPE tokenizer (`_pre_tokenizer` checked it) as llama.cpp's `gpt2` model:
    tokens by id, control tokens marked, merges, special ids, the pre-tokenizer's name, the
    chat template."""
    model = backend["model"]
    vocab = tok.get_vocab()
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    special = set(tok.all_special_ids) | {
        int(i) for i, t in tok.added_tokens_decoder.items() if t.special
    }
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    for add, value in (
        (writer.add_bos_token_id, tok.bos_token_id),
        (writer.add_eos_token_id, tok.eos_token_id),
        (writer.add_pad_token_id, tok.pad_token_id),
        (writer.add_unk_token_id, tok.unk_token_id),
    ):
        if value is not None:
            add(int(value))
    bos = tok.bos_token_id  # added by the tokenizer's post-processor or its flag: ask it
    writer.add_add_bos_token(bos is not None and tok("a").input_ids[:1] == [bos])
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
