"""Translating: search over token ids, the translator, compiled decoding, the shortlist, sacreBLEU, pictures."""
