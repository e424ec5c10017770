"""One token's projection (the decode step's linear layers), streaming the weight once."""
