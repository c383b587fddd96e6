"""How a request's run on the workers can fail, as the router's modules tell each other."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """No live worker can take, or finish, the request (the server answers 503)."""


class Retry(Exception):
    """This attempt of a child cannot go on; run it again (counts as a migration)."""


class ClusterError(RuntimeError):
    """The cluster engine (Ray) cannot be reached or cannot hold the layout: one line,
    naming what is missing, before any worker starts."""
