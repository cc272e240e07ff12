"""Engine core bookkeeping: requests, sampling parameters, the block pool, the KV cache manager,
the scheduler, statistics and detokenization. Pure Python: importing it loads no torch."""
