"""Expert parallelism with data-parallel attention.

groups.py    process group from the torchrun environment (NCCL on GPU, gloo on CPU), NVLink multicast off
exchange.py  MoEExchange: the per-layer MoE exchange (gate locally, all-gather FP8 rows, local experts,
             reduce-scatter fp32), a drop-in for mini.ops.moe.moe passed as Model(..., moe_exchange=...)
dp.py        DPModel (one rank's model, as the engine steps it) and DP generation over the ranks
launch.py    the one launcher: torchrun entry, local ranks (spawn for results, run_local for servers)
serve.py     DP serving: the request router and lock step on rank 0 (DPDriver, an AsyncLLM driver), one engine
             per rank; rank 0's HTTP server is the caller's (`mini serve --ep N`, `torchrun ... -m mini serve`)
step_shape.py  the per-step agreement of the ranks (over a gloo host group): one decode-graph bucket for all, or
             every rank eager (DPModel.agree_step, before every forward)
balance.py   DP balance (pure Python): where a new request goes (Placement, by the ranks' loads) and the per-step
             prefill cap that keeps a decoding rank from waiting on another's long prefill chunk
"""
