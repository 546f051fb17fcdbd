"""The OpenAI protocol layer, one for the instance and the router.

* `protocol`: request bodies (pydantic) and the error JSON;
* `errors`: `APIError` and the handlers that turn every refusal into that JSON;
* `prompt`: a request's prompt as token ids (chat template, tools, text, ids);
* `render`: response bodies, stream chunks and usage;
* `chat_output` (over `tool_parsers` and `reasoning`): a chat answer's tool calls
  and reasoning, parsed whole or as it streams (torch-free);
* `structured`: response_format / forced tool_choice as a grammar; forced answers as tool calls.

Both sides validate with the same models, build the same prompt ids and give
the same error messages, so a request refused by the router is refused in the
words an instance would use.
"""
