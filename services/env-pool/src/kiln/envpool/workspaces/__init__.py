"""A sandbox's files: task templates and clones, overlay roots and their upper layers, bounded walks
over whatever the agent left there, and the final diff as a git patch."""
