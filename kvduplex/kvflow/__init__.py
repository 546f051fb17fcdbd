"""The KV flows between instances, built on `kvduplex.transport`.

* `sender.KVSender` WRITEs blocks into a peer's registered blocks: a prefill
  request's prompt layer by layer as it computes (push), or a finished turn's
  blocks at once (return).
* `receiver.KVReceiver` registers destination blocks with a sender and waits,
  with deadlines, heartbeats and quarantine, for them to be filled.
* `push_decode` (decode's side of push), `returns` (the duplex return on both
  sides), `pull` and `lease` (the pull baseline), `connectors` (each role's
  engine connector).
* `inbox` (one per instance: other threads put typed events, the engine thread
  drains them; no flow state is touched elsewhere) and `flow_io` (one thread
  for messages and calls that may block).
"""
