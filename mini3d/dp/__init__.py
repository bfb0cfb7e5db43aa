"""Data parallelism: bucketed overlapped gradient sync (ddp.py), one strategy object per ZeRO stage
(stage.py; zero0.py DDP, zero1.py, zero2.py over ddp's buckets; zero3.py gathering per unit), the
entry point and the sharded optimizer with bf16 mixed precision and fp32 masters (zero.py:
`make_dp`, `STAGES`), and the memory ledger."""

from mini3d.dp.ddp import DataParallel
from mini3d.dp.ledger import model_state_ledger
from mini3d.dp.zero import DTYPES, STAGES, ShardedOptimizer, make_dp, zero_stage
from mini3d.dp.zero3 import FullyShardedDP

__all__ = ["DTYPES", "DataParallel", "FullyShardedDP", "STAGES", "ShardedOptimizer", "make_dp",
           "model_state_ledger", "zero_stage"]
