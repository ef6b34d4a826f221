"""Expert parallelism with data-parallel attention.

groups.py    process group from the torchrun environment (NCCL on GPU, gloo on CPU), NVLink multicast off
exchange.py  MoEExchange: the per-layer MoE exchange (gate locally, all-gather FP8 rows, local experts,
             reduce-scatter fp32), a drop-in for mini.ops.moe.moe passed as Model(..., moe_exchange=...)
launch.py    torchrun entry and local multi-process spawn
serve.py     DP serving: HTTP + request router on rank 0, one engine per rank, steps in lock step
             (`mini serve --ep N`, `torchrun ... -m mini serve`, `torchrun ... -m mini generate`)
"""
