"""Policy versions: manifests, deltas, and the receiving side of the weight transports."""
