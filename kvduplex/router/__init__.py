"""The router: the OpenAI front door over prefill and decode instances.

* `app`: HTTP routes, validation and prompt ids (shared with the instances);
* `policy`, `sessions`: which instances serve a request (sessions, pairing);
* `backends`: the instances of each role (members, load, health);
* `flows`: push, pull, decode alone;
* `relay`: decode's answer to the client, prefill's first token first;
* `state`, `metrics`: what they share; ``kvduplex_router_*`` metrics.
"""
