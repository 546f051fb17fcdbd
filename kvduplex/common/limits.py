"""What a request may ask for, checked the same way by the router and the instance."""

from __future__ import annotations


def check_request_size(max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raise RequestRejected when a request of this size can never be served (the router
    checks with the instances' `max_model_len` before it dispatches anything)."""
    if num_prompt_tokens < 1:
        raise RequestRejected("the prompt is empty; send at least one token")
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestRejected(
            f"this model's maximum context length is {max_model_len} tokens, but the "
            f"request asks for {total} ({num_prompt_tokens} in the prompt + {max_tokens} "
            "to generate); shorten the prompt or lower max_tokens"
        )


class RequestRejected(ValueError):
    """A request that can never be served as asked (e.g. too long); the message says why."""
