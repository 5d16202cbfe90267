"""Cache-aware HTTP router across Tandem engines (its own process; imports only ``proto/``)."""
