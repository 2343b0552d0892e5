"""The OpenAI-compatible HTTP server: routes, protocol models, serving logic."""
