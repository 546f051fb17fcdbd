"""The instance process (`kvduplex serve`): its HTTP server (the OpenAI API, health,
metrics and the internal KV routes) over one engine and its KV flows.

* `server`: builds the engine, the transport and the flows, and serves them;
* `api`: the OpenAI API over the engine;
* `kv_routes`, `decode_routes`: the internal routes of the prefill and decode halves.
"""
