"""Trained speculator networks (``genspec train``): the draft head, Medusa heads and the distilled draft,
and their saved form; the drafters that run them are in :mod:`genspec.drafters`."""
