"""The scheduling layer: the scheduler's five steps and their plan, the block manager, pool
arithmetic and prompt-lookup drafts. Standard library only: no torch, no model (see ARCHITECTURE.md)."""
