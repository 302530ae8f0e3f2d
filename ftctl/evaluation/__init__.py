"""Generation and scoring on held-out data: `ftctl eval` (generation is shared with chat/generate)."""
