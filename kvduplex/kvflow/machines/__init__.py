"""The KV flows' transfer state machines: pure (sans-IO) protocol state.

Each machine takes typed events (a message arrived, a WRITE ended, a tick with
the clock's value) and returns typed actions (post a transfer, tell the peer,
take or drop block references); no threads, no clock, no I/O inside. The
flows' halves (`kvduplex.kvflow.sender.KVSender`,
`kvduplex.kvflow.receiver.KVReceiver`) are the adapters that feed them and
carry their actions out.

* `send`: one transfer this instance WRITEs (push and return, one machine with
  a source strategy; its sources, events and actions are in `send_events`);
* `receive`: one registration this instance waits on (and its quarantine);
* `read`: one READ of a peer's blocks (pull, retained turns; run by
  `kvduplex.kvflow.half.ReadRunner`);
* `actions`: the actions both share.
"""
