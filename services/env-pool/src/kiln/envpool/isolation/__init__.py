"""Isolation of sandboxed commands: namespaces (bubblewrap), cgroups, seccomp, and the zygote that
spawns every command with its limits. Nothing here knows about tasks or tools."""
