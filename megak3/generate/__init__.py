"""``python -m megak3.generate``: the generation CLI and ``serve`` (the OpenAI-style HTTP server).
The code lives in megak3/inference/cli.py and megak3/inference/server.py."""
