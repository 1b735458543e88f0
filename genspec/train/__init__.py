"""Training speculators for a target model (``genspec train``): data, losses, loop; the networks it trains
are in :mod:`genspec.speculators`."""
