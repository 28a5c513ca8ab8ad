"""The web dashboard over the platform's database (``kiln dashboard``)."""

from kiln.shared.dashboard.app import create_app

__all__ = ["create_app"]
