"""pdserve.sim: vLLM-compatible simulated engines and render server for GPU-free tests and demos.

They speak vLLM's HTTP contract (docs/simulator.md; the bodies in pdserve/vllm/protocol.py) over
a small deterministic tokenizer shared by render and engines, so text <-> token ids round-trips
and tests can predict every answer."""
