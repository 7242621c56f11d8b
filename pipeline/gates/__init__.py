"""Gates: what the promotion verdict rests on, and the statistics that keep its error rate.

- ``suites``: what a suite counts (duplicates, correlated groups, specialists no suite judges).
- ``answers``: a pair's answers to suite items and their scores, item by item.
- ``inference``: the paired improvement and non-inferiority tests.
- ``retention``, ``divergence``, ``transfer``: what a lineage must keep, how far it moved, and the accuracy
  matrix with backward transfer.
"""
