"""Corpora: reading, cleaning and batching text, prepared (memory-mapped) corpora, the demo's synthetic task."""
