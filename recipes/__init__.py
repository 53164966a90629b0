"""Shipped recipes (YAML); a package only so that they install with cca_convert."""
