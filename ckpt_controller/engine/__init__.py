"""The reference engine: a small, deterministic torch LM server that embeds the agent.

    model       TinyLM, presets (tiny, small, sizes), weights in safetensors  (torch)
    kv          BlockPool: the paged KV cache                                  (torch)
    scheduler   continuous batching, preemption, keep/resume                   (torch via model)
    api         the request API's wire messages (no torch)
    client      EngineClient and the load generator (no torch)
    server      ReferenceEngine: the process that ties them to the agent

Importing this package imports no torch; the client side stays light.
"""
