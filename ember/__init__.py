"""ember: LLM serving for agents."""
