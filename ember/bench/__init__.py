"""`ember bench`: load generation against OpenAI-compatible servers, and its reports."""
