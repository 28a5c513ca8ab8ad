"""External agent harnesses as rollout sources: the per-episode OpenAI-compatible endpoint
(``server``), the token-faithful recording of its calls (``episode``), the harness runners
(``runners``) and the exec bridge's CLI (``bridge``). docs/harnesses.md."""
