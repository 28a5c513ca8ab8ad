"""The agent's tools run against one sandbox: the executor (read, edit, terminal, ...) and the two
search tools."""
