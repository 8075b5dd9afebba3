"""What the model's forward calls: the paged KV cache tensors, the attention backends (plain torch,
the CPU C kernel, Triton), packed and fused linears with their GEMMs, the C build cache and the
compiled forward. torch; never schedules (see ARCHITECTURE.md)."""
