"""Training speculators for a target model (``genspec train``): draft heads on its own features."""
