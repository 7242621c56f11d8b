"""The registry dashboard (``ratchet dashboard``): the lineage, each generation's evidence, held-out items,
provenance, trends, experience, conversations and records, as server-rendered pages and a JSON API.

``overview`` (the lineage at a glance), ``lineage``, ``comparison``, ``provenance``, ``experience``, ``trace``,
``conversation`` and ``records`` compute what is shown (``replies``: what the API returns); ``charts`` draws
it; ``security`` decides who may act; ``actions`` acts; ``webapp`` serves it all.
"""

from pipeline.dashboard.webapp import create_app

__all__ = ["create_app"]
