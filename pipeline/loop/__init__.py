"""The loop: starting a lineage and advancing it one generation at a time.

``founding`` starts a lineage (generation 0). ``advance`` orchestrates one generation over the steps, each in the
module named by its noun: ``discovery``, ``collection``, scoring (``pipeline.scoring``), ``curation``, training
(``pipeline.training``), co-design (``pipeline.codesign``), ``evaluation`` and ``promotion``. ``candidate`` is
the generation every step works on, ``lease`` keeps one builder at a time, ``clock`` says where the time went,
and ``adoption`` moves a lineage to a new contract version.
"""
