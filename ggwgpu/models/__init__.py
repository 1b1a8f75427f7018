"""Model graphs built from the registered ops."""
