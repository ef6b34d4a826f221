"""Test and measurement support, shared by mini/bench, mini/check, tests/ and tools/; the product (config, formats,
checkpoint, ops, kernels, model, engine, server, parallel) never imports it (tests/test_import_graph.py).

suites.py             the registry of command-line suites and their JSON results (`mini bench`, `mini check`)
emulated_ep.py        one EP rank's MoE emulated on one device (`EmulatedEP`) and the skewed routing (`RoutingSkew`)
rank_model.py         one EP rank's model with random weights at a preset's shape, its prefill batch, Engram tables
rank_step.py          that rank's prefill steps as a server runs them (the next input built while the GPU works)
background_server.py  an app served from a thread of this process (`with BackgroundServer(app) as url`)
stage_times.py        the per-stage timer of a forward step (`mini profile`, ep-prefill's and rank4-decode's stages)
serving_load.py       a fixed random serving workload, streamed to a server, and its TTFT / TPOT summary
oracle_drafter.py     a drafter that proposes a plain run's own continuation, wrong where a test plans it
flashmla_stand_in.py  FlashMLA's sparse prefill as a per-row reference on CPU, for the deterministic mode's split
"""
