"""The reference engine: a small, deterministic torch LM server that embeds the agent.

    model       TinyLM, presets (tiny, small, sizes), weights in safetensors  (torch)
    kv          BlockPool: the paged KV cache                                  (torch)
    scheduler   continuous batching, preemption, keep/resume                   (torch via model)
    api         the request API's wire messages (no torch)
    client      EngineClient: submit, poll, generate (no torch)
    load        the load generator behind ``ckptctl load`` and the drills (no torch)
    server      ReferenceEngine: the process that ties them to the agent

Importing this package imports no torch; the client side stays light.
Neighbours: ``agent`` (embedded by ``server``), ``memory`` (the weights file and the registry
the agent drives); above, ``cli`` (``ckptctl engine serve``, ``generate``, ``load``, ``demo``)
and ``drill`` start engines and send them load.
"""
