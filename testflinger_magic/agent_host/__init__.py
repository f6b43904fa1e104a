"""agent_host."""
