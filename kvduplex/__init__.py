"""kvduplex: prefill/decode disaggregated LLM serving with layer-wise KV push and duplex return."""

__version__ = "0.1.0"
