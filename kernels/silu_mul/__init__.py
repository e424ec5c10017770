"""The MLP's gate, silu(g) * u, over the gate_up projection's output."""
