"""The web dashboard over the platform's database (``kiln dashboard``)."""

from kiln.ops.dashboard.app import create_app

__all__ = ["create_app"]
