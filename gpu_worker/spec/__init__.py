"""Speculative decoding: frozen-KV MTP's draft chain and the verify/accept rule (``mtp``)."""
