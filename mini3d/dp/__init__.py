"""Data parallelism: bucketed overlapped gradient sync (ddp.py), ZeRO 1/2 (ddp.py + zero.py),
ZeRO-3 (zero3.py), bf16 mixed precision with fp32 masters (zero.py), and the memory ledger."""

from .ddp import DataParallel
from .ledger import model_state_ledger
from .zero import DTYPES, ShardedOptimizer, make_dp
from .zero3 import FullyShardedDP

__all__ = ["DTYPES", "DataParallel", "FullyShardedDP", "ShardedOptimizer", "make_dp", "model_state_ledger"]
