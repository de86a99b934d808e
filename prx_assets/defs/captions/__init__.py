"""The caption stage: captions, caption classes and caption embeddings, and model swaps."""
