"""Consistent snapshots of a live region and their renderers (`tract inspect`)."""
