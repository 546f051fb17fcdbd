"""What both processes use, torch-free: settings, request limits, sampling parameters,
the OpenAI protocol layer, the tokenizer and chat template, the model's description,
the KV layout, the cluster secret and the HTTP guards shared by the instance and the router."""
