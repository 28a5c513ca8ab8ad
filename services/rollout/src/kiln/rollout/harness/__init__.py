"""External agent harnesses as rollout sources: the per-episode OpenAI-compatible endpoint
(``server``) answered by the sample's ``kiln.rollout.episode.Episode``, the external
harnesses (``external.ExternalHarness``, a ``kiln.rollout.lifecycle.Harness`` beside kiln's own loop)
and the exec bridge's CLI (``bridge``). docs/harnesses.md."""
