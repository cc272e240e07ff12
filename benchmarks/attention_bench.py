"""Paged decode attention candidates at the engine's decode shapes, one layer, same inputs.

`python -m benchmarks.attention_bench [--sequences 64] [--min-len 50] [--max-len 260] [--rounds 20]
[--device cpu|cuda]`

Shapes of the 25M Llama (8 heads, 4 KV heads, head dim 64, KV blocks of 8), float32, each
sequence's blocks scattered at random over the pool. Candidates:
- `paged-cpu`: the engine's C kernel, reading K/V from the blocks in place (`serve/cpu_attention`);
- `sdpa`: the SDPA backend, gathering each group's blocks and padding to the group's longest;
- `flex`: FlexAttention compiled for the CPU (inductor), all queries as one sequence over the
  flat slot pool, with a block mask of (1 query x 8 slots) blocks built from the block tables
  (mask: the slot belongs to the query's sequence and lies before its length). Compile time and
  block-mask time are reported apart; `--no-flex` skips it (and it runs only on the CPU);
- `flex-backend`: the engine's `flex` backend (`serve/model/flex_attention.py`): on CUDA compiled
  Triton over the cache in place, on the CPU eager over gathered blocks;
- `padded-sdpa`: the engine's `padded-sdpa` backend, every decode in one SDPA call.
The two engine backends are timed on a second layer of the step (their block masks and batches
are built by the first layer of each forward: that time is printed apart).
Reports the median time per call (min-max) against the baseline (paged-cpu on the CPU, sdpa on
CUDA) and the largest difference to the reference backend.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from serve.model.attention import AttentionMetadata
from serve.model.cpu_attention import PagedCPUBackend
from serve.model.flex_attention import FlexAttentionBackend
from serve.model.padded_attention import PaddedSDPABackend
from serve.model.sdpa_attention import DECODE_GROUP_SIZE, ReferenceBackend, SDPABackend
from serve.model.step_inputs import decode_groups

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 8


def flex_candidate(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: list[list[int]], lens: list[int]
) -> tuple[Callable[[], torch.Tensor], dict[str, float]]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    slots = k.shape[0] * BLOCK
    slot_seq = torch.full((slots,), -1, dtype=torch.int32)
    slot_pos = torch.zeros(slots, dtype=torch.int32)
    for s, table in enumerate(tables):
        for j, b in enumerate(table):
            slot_seq[b * BLOCK : (b + 1) * BLOCK] = s
            slot_pos[b * BLOCK : (b + 1) * BLOCK] = torch.arange(j * BLOCK, (j + 1) * BLOCK)
    seq_len = torch.tensor(lens, dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (slot_seq[kv_idx] == q_idx) & (slot_pos[kv_idx] < seq_len[q_idx])

    start = time.perf_counter()
    mask = create_block_mask(
        mask_mod, 1, None, len(lens), slots, device="cpu", BLOCK_SIZE=(1, BLOCK)
    )
    mask_s = time.perf_counter() - start
    kf = k.view(-1, KV_HEADS, HEAD_DIM).permute(1, 0, 2)[None].contiguous()
    vf = v.view(-1, KV_HEADS, HEAD_DIM).permute(1, 0, 2)[None].contiguous()
    qf = q.transpose(0, 1)[None].contiguous()
    compiled = torch.compile(flex_attention)

    def run() -> torch.Tensor:
        out = compiled(qf, kf, vf, block_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True)
        return out[0].transpose(0, 1)

    start = time.perf_counter()
    run()
    return run, {"block_mask_s": mask_s, "compile_s": time.perf_counter() - start}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=50)
    parser.add_argument("--max-len", type=int, default=260)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rng = random.Random(0)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.sequences)]
    counts = [-(-n // BLOCK) for n in lens]
    pool = list(range(sum(counts) + 64))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(c)] for c in counts]
    torch.manual_seed(0)
    shape = (sum(counts) + 64, BLOCK, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape).to(device), torch.randn(shape).to(device)
    q = torch.randn(len(lens), HEADS, HEAD_DIM).to(device)
    scale = HEAD_DIM**-0.5

    rows = list(range(len(lens)))
    first_layer = (torch.zeros_like(k), torch.zeros_like(v))

    def meta(size: int | None) -> AttentionMetadata:
        groups = decode_groups(rows, tables, lens, BLOCK, size, device)
        return AttentionMetadata([first_layer, (k, v)], torch.empty(0), [], groups, SDPABackend())

    reference = ReferenceBackend().attend(q, k, v, meta(None), scale)
    sdpa, flex, padded = SDPABackend(), FlexAttentionBackend(), PaddedSDPABackend()
    one_group, groups_of_16 = meta(None), meta(DECODE_GROUP_SIZE)
    candidates: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa": lambda: sdpa.attend(q, k, v, groups_of_16, scale),
        "flex-backend": lambda: flex.attend(q, k, v, one_group, scale),
        "padded-sdpa": lambda: padded.attend(q, k, v, one_group, scale),
    }
    if device.type == "cpu":
        paged = PagedCPUBackend()
        candidates = {"paged-cpu": lambda: paged.attend(q, k, v, one_group, scale), **candidates}
    for name, backend in (("flex-backend", flex), ("padded-sdpa", padded)):
        start = time.perf_counter()
        backend.attend(q, *first_layer, one_group, scale)  # builds the step's batches
        backend.attend(q, k, v, one_group, scale)  # compiles, on CUDA
        sync(device)
        print(f"{name}: the step's batches and first calls {time.perf_counter() - start:.2f} s")
    threads = torch.get_num_threads()
    print(f"{len(lens)} sequences, {sum(lens)} context tokens, float32, {threads} threads")
    if not args.no_flex and device.type == "cpu":
        run, setup = flex_candidate(q, k, v, tables, lens)
        candidates["flex"] = run
        mask_s, compile_s = setup["block_mask_s"], setup["compile_s"]
        print(f"flex: block mask {mask_s:.2f} s, compile + first call {compile_s:.1f} s")
    _time(candidates, reference, args.rounds, device)
    return 0


def _time(
    candidates: dict[str, Callable[[], torch.Tensor]],
    reference: torch.Tensor,
    rounds: int,
    device: torch.device,
) -> None:
    """Each candidate checked against the reference once, then timed `rounds` times in turn;
    medians as ratios to the first candidate."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for name, run in candidates.items():
                start = time.perf_counter()
                out = run()
                sync(device)
                if r:
                    times[name].append(time.perf_counter() - start)
                else:
                    diff = (out - reference).abs().max().item()
                    print(f"{name}: largest difference to the reference {diff:.2e}")
    baseline = next(iter(candidates))
    base = statistics.median(times[baseline])
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:>12}: {median * 1000:6.2f} ms per layer ({min(values) * 1000:.2f}-"
            f"{max(values) * 1000:.2f}), x{median / base:.2f} of {baseline}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
